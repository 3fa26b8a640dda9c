"""The one place that decides how a recurrence runs.

* :func:`recurrence` runs a sequence, ``(map, factors, h0, mask, chunk, offset, impl, ...) -> (states, final)``:
  a CP map (:class:`~.bilinear_reference.CPTransition`, no additive input) takes a rank-space scan, every other map the
  reference loop, and a single position (decoding) one :func:`~.bilinear_reference.reference_step` (for a CP map on CPU
  without gradients, eager, its C++ twin ``cp_step``; inside a compiled decoding step the PyTorch ops, which Inductor
  fuses with the rest of the step).
  :func:`resolve_impl` picks the scan: ``"cpp"`` (the C++ CPU scan, ``bilinear_lm.kernels.cpu``, where the package
  is installed; CPU fp32/fp64), ``"triton"`` (``bilinear_scan_triton``, CUDA; imported only when chosen), ``"torch"``
  (``bilinear_scan``, any device) or ``"reference"`` (the loop itself).
* :func:`memory_recurrence` runs the memory heads' gated delta rule: the chunked form (``delta_rule_chunk``) for a
  sequence; one position as the bilinear step does, the C++ ``delta_rule_step`` in eager decoding on CPU, else the
  loop's PyTorch step; ``impl="reference"``: the loop.
* :func:`cp_recurrence` is the CP entry with the scan's signature ``(u, W1, W2, h0, mask, chunk, offset)``.
* :func:`linear` is how the modules apply their projections: an eager decoding step's few CPU rows take the C++
  GEMV (the layers stay plain ``nn.Linear``, so adapters such as LoRA keep working); a compiled one ``layer(x)``,
  or the GEMV as a custom op where MKL's is slow (``GEMV_IN_COMPILED_STEPS``).
* :func:`swiglu`, :func:`rms_norm` and :func:`state_norm` are the MLP's gated activation, the blocks' norm and the
  mixer's per-head norm of its states: on CPU fp32/fp64 tensors where the C++ kernels are loaded, outside a compiled
  graph, one pass each way with one output (``fused.cpp``; PyTorch runs each as 3-10 ops that each allocate a
  result; first-order gradients only, as the scans); else the PyTorch formulas. They never build the kernels (the
  scan or ``transitions.build_kernels`` does).

The scans are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces through them.
"""

import math
import re
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_bilinear import RECURRENCE_IMPLS as IMPLS
from .bilinear_reference import CPTransition, reference_recurrence, reference_step
from .bilinear_scan import scan_backward as torch_scan_backward
from .bilinear_scan import scan_forward as torch_scan_forward
from .bilinear_scan import sequence_major
from .chunked_normalization import SAFE_MAX, SAFE_MIN, is_boundary
from .delta_rule_chunk import chunk_delta_rule
from .delta_rule_reference import reference_delta_rule

try:  # the compiled CPU kernels ship with the package; remote code (save_pretrained) runs PyTorch without them
    from bilinear_lm.kernels.cpu import load as load_cpu_kernels
    from bilinear_lm.kernels.cpu import loaded as loaded_cpu_kernels
except ImportError:
    load_cpu_kernels = loaded_cpu_kernels = None


@torch.compiler.assume_constant_result
def cpu_kernels_available() -> bool:
    """Whether the C++ CPU kernels are built, or build now (once). ``torch.compile`` keeps the answer it traced."""
    return load_cpu_kernels is not None and load_cpu_kernels() is not None


# One library per copy of this module: the package and a remote-code copy of it may be imported side by side.
_NAMESPACE = re.sub(r"\W", "_", __name__.rpartition(".")[0])
SMALL_BATCH_ROWS = 4  # decoding: up to this many rows take the GEMV


def _mkl_gemv_is_slow() -> bool:
    """Whether ``F.linear``'s few-row products run MKL's GEMV on a CPU it serves slowly: MKL (torch's x86 CPU BLAS)
    picks slow code paths on non-Intel CPUs (AMD EPYC: 14.8 GB/s of a 70 GB/s copy; docs/results.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return torch.backends.mkl.is_available() and vendor not in ("", "GenuineIntel")


# A compiled decoding step calls the C++ GEMV (as a custom op) where MKL's is slow; elsewhere Inductor plans the
# projections with the rest of the step (faster on Intel CPUs: docs/results-history.md, issue 36).
GEMV_IN_COMPILED_STEPS = _mkl_gemv_is_slow()


@torch.compiler.assume_constant_result
def _gemv_loaded() -> bool:
    return loaded_cpu_kernels is not None and loaded_cpu_kernels() is not None


@torch.library.custom_op(f"{_NAMESPACE}::small_batch_linear", mutates_args=())
def _small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return loaded_cpu_kernels().small_batch_linear(x.contiguous(), weight.contiguous())


@_small_batch_linear.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, except that a plain ``nn.Linear`` (no hooks, no bias) on at most ``SMALL_BATCH_ROWS`` fp32/fp64
    CPU rows without gradients or autocast, a decoding step's projection, runs the C++ GEMV when the kernels are loaded
    (2-3x ``F.linear`` on the CPUs measured; docs/results.md): eagerly, and in a compiled step where
    ``GEMV_IN_COMPILED_STEPS`` (as a custom op). Anything else, adapters such as LoRA included, is ``layer(x)``;
    this never builds the kernels."""
    if x.numel() > SMALL_BATCH_ROWS * x.shape[-1] or torch.is_grad_enabled() or type(layer) is not nn.Linear:
        return layer(x)  # the common cases first: this runs for every projection
    compiling = torch.compiler.is_compiling()
    weight = layer.weight
    if ((compiling and not GEMV_IN_COMPILED_STEPS) or x.device.type != "cpu" or x.dtype != weight.dtype
            or x.dtype not in (torch.float32, torch.float64) or layer.bias is not None
            or layer._forward_hooks or layer._forward_pre_hooks or torch.is_autocast_enabled("cpu")
            or not _gemv_loaded()):
        return layer(x)
    rows = x.reshape(-1, x.shape[-1])
    y = _small_batch_linear(rows, weight) if compiling else loaded_cpu_kernels().small_batch_linear(
        rows.contiguous(), weight.contiguous())
    return y.view(*x.shape[:-1], weight.shape[0])


def _cpu_kernels_run_on(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64) and cpu_kernels_available()


def _step_kernel_runs(impl: str, tensor: torch.Tensor) -> bool:
    """Whether one position runs a C++ step kernel (``cp_step``, ``delta_rule_step``): eager decoding, that is no
    gradients and no compiled graph (there Inductor fuses the PyTorch step with the rest), ``impl`` auto or cpp, and
    the kernels on ``tensor``."""
    return impl in ("auto", "cpp") and not torch.is_grad_enabled() and not torch.compiler.is_compiling() \
        and _cpu_kernels_run_on(tensor)


def _step_flags(flags: torch.Tensor | None) -> torch.Tensor:
    """Per-row flags (``[B]``: keep, restart) as the step kernels take them: contiguous bool, empty for none."""
    return torch.empty(0, dtype=torch.bool) if flags is None else flags.bool().contiguous()


def resolve_impl(impl: str, u: torch.Tensor, rank: int, state_size: int) -> str:
    """The implementation that runs the CP recurrence on factors ``u`` ``[B, T, ...]`` (a scan of ``rank`` in rank
    space, a state of ``state_size``): one of ``IMPLS`` but ``"auto"``.

    ``"auto"``: the Triton kernels on CUDA when Triton imports, the C++ kernel on CPU when it builds here, else the
    PyTorch scan; but the reference loop for a single position (the scans' setup costs more than one step) and, off
    the GPU, when ``rank > 2 * state_size`` (the scans cost ``rank^2`` per step, the loop ``2 * rank * state_size``).
    """
    if impl not in IMPLS:
        raise ValueError(f"recurrence_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if u.shape[1] == 1:
            return "reference"
        if u.is_cuda and _triton_available(u.device.type):
            return "triton"
        if rank > 2 * state_size:
            return "reference"
        return "cpp" if _cpu_kernels_run_on(u) else "torch"
    if impl == "cpp" and not _cpu_kernels_run_on(u):
        raise RuntimeError("recurrence_impl='cpp' needs CPU fp32/fp64 tensors, the installed package "
                           "(pip install bilinear-lm) and a C++ compiler for the scan's build, without "
                           "BILINEAR_LM_NO_CPP=1; use recurrence_impl='auto' or 'torch'")
    if impl == "triton" and not _triton_available(u.device.type):
        raise RuntimeError("recurrence_impl='triton' needs CUDA tensors and Triton (pip install triton; on CPU only "
                           "under TRITON_INTERPRET=1); use recurrence_impl='auto' or 'torch'")
    return impl


@torch.compiler.assume_constant_result
def _triton_available(device_type: str) -> bool:
    from .bilinear_scan_triton import available  # imported only here: CPU-only use never loads Triton

    return available(device_type)


def _scan_functions(impl: str):
    """``(scan_forward, scan_backward)`` of ``impl`` (remote code can import only ``from .module import name``)."""
    if impl == "cpp":  # the kernels import nothing from this package: they take the overflow guard's range
        kernel = load_cpu_kernels()
        return partial(kernel.scan_forward, safe_min=SAFE_MIN, safe_max=SAFE_MAX), kernel.scan_backward
    if impl == "triton":
        from .bilinear_scan_triton import scan_backward, scan_forward

        return scan_forward, scan_backward
    return torch_scan_forward, torch_scan_backward


@torch.library.custom_op(f"{_NAMESPACE}::cp_scan", mutates_args=())
def cp_scan(u: torch.Tensor, Mt: torch.Tensor, p0: torch.Tensor, keep: torch.Tensor, W1: torch.Tensor, chunk: int,
            offset: int, restart: torch.Tensor, p_start: torch.Tensor,
            impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank-space scan ``(G, P, S)`` of ``bilinear_scan.scan_forward``, run by ``impl`` (torch, cpp or triton)."""
    # A tuple, as the schema says: the C++ function returns a list, and torch 2.14 attaches no autograd to a list
    # (the outputs had no grad_fn: W2, factor_bias and h_start never trained).
    return tuple(_scan_functions(impl)[0](u, Mt, W1, keep, p0, chunk, offset, restart, p_start))


@cp_scan.register_fake
def _(u, Mt, p0, keep, W1, chunk, offset, restart, p_start, impl):
    T, N, B, R = u.shape
    return sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, R), sequence_major(u, T, N, B, 1)


@torch.library.custom_op(f"{_NAMESPACE}::cp_scan_backward", mutates_args=())
def cp_scan_backward(dG: torch.Tensor, u: torch.Tensor, S: torch.Tensor, P: torch.Tensor, p0: torch.Tensor,
                     p_start: torch.Tensor, MtT: torch.Tensor, keep: torch.Tensor, restart: torch.Tensor,
                     impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's reverse loop: ``(du, DP, dp0, dp_start)`` of ``bilinear_scan.scan_backward``."""
    return tuple(_scan_functions(impl)[1](dG, u, S, P, p0, p_start, MtT, keep, restart))


@cp_scan_backward.register_fake
def _(dG, u, S, P, p0, p_start, MtT, keep, restart, impl):
    T, N, B, R = u.shape
    return torch.empty_like(u), sequence_major(u, T, N, B, R), u.new_empty(N, B, R), u.new_empty(N, B, R)


def _cp_scan_setup_context(ctx, inputs, output):
    u, Mt, p0, keep, _, _, _, restart, p_start, impl = inputs
    G, P, S = output
    ctx.save_for_backward(u, Mt, p0, keep, restart, p_start, G, P, S)
    ctx.impl = impl
    ctx.set_materialize_grads(False)  # P and S feed nothing differentiable: no zeros for their gradients


def _cp_scan_backward_rule(ctx, dG, dP, dS):
    """Gradients of ``u``, ``Mt``, ``p0`` and ``p_start``."""
    u, Mt, p0, keep, restart, p_start, G, P, S = ctx.saved_tensors
    du, DP, dp0, dp_start = cp_scan_backward(dG, u, S, P, p0, p_start, Mt.transpose(1, 2).contiguous(), keep, restart,
                                             ctx.impl)
    dMt = torch.einsum("tnbr,tnbs->nrs", G, DP)  # G and DP sequence-major: per-head matmuls, no copies
    return du, dMt, dp0, None, None, None, None, None, dp_start.sum(1) if restart.numel() else None, None


cp_scan.register_autograd(_cp_scan_backward_rule, setup_context=_cp_scan_setup_context)


def _fused_run_on(*tensors) -> bool:
    """Whether the fused blocks' C++ kernels take ``tensors``: loaded, eager, one fp32/fp64 dtype, on CPU."""
    if torch.compiler.is_compiling() or loaded_cpu_kernels is None or loaded_cpu_kernels() is None:
        return False  # compiled: Inductor fuses the PyTorch ops itself
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.float64) and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


@torch.library.custom_op(f"{_NAMESPACE}::swiglu", mutates_args=())
def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return loaded_cpu_kernels().swiglu_forward(gate_up)


@_swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op(f"{_NAMESPACE}::swiglu_backward", mutates_args=())
def _swiglu_backward(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    return loaded_cpu_kernels().swiglu_backward(gate_up, dh)


@_swiglu_backward.register_fake
def _(gate_up, dh):
    return gate_up.new_empty(gate_up.shape)


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


_swiglu.register_autograd(lambda ctx, dh: _swiglu_backward(ctx.saved_tensors[0], dh),
                          setup_context=_swiglu_setup_context)


def swiglu(gate_up: torch.Tensor, act) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up = [gate | up]`` on the last dimension (the MLP's fused projection); SiLU by the
    C++ kernels where they run (see the module docstring): its gradient is one tensor, not two halves concatenated."""
    if act is F.silu and _fused_run_on(gate_up):
        return _swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight x r, r)`` with ``r = 1 / max(sqrt(mean(x^2) + eps), floor)`` over the last dimension; ``weight``
    ``[G, D]`` (or ``[D]``) is repeated over the rows of ``x`` (``[..., G, D]``)."""
    return tuple(loaded_cpu_kernels().rms_norm_forward(x, weight, eps, floor))


@_rms_norm.register_fake
def _(x, weight, eps, floor):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1])


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(loaded_cpu_kernels().rms_norm_backward(dy, x, weight, rstd, floor))


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd, floor):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _, ctx.floor = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # r feeds nothing differentiable


def _rms_norm_backward_rule(ctx, dy, dr):
    return *_rms_norm_backward(dy, *ctx.saved_tensors, ctx.floor), None, None


_rms_norm.register_autograd(_rms_norm_backward_rule, setup_context=_rms_norm_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in at least fp32, in ``x``'s dtype; by
    the C++ kernels where they run (see the module docstring)."""
    if _fused_run_on(x, weight):
        return _rms_norm(x, weight, eps, 0.0)[0]
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x).to(dtype)


def state_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h / ||h|| * sqrt(H) * weight`` for states ``h [..., N, H]`` and ``weight [N, H]``: each head's state at unit
    norm (the norm clamped to the smallest normal number, no eps: exactly scale invariant), then a learned scale; by
    the C++ kernels where they run (see the module docstring: an RMSNorm without eps, a contiguous result)."""
    tiny = torch.finfo(h.dtype).tiny
    if _fused_run_on(h, weight):
        return _rms_norm(h.contiguous(), weight, 0.0, tiny / math.sqrt(h.shape[-1]))[0]
    return h / h.norm(dim=-1, keepdim=True).clamp_min(tiny) * (math.sqrt(h.shape[-1]) * weight.to(h.dtype))


def cp_recurrence(u, W1, W2, h0, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto", reset=None,
                  h_start=None):
    """The CP-factored recurrence, equal to ``reference_recurrence(CPTransition(W1, W2), u, h0, ...)``.

    Args:
        u: ``[B, T, N, R]`` input factors. W1, W2: ``[N, H, R]``. h0: ``[N, H]`` or ``[B, N, H]``.
        mask, chunk, offset, reset: as in :func:`~.bilinear_reference.reference_recurrence`. h_start: ``[N, H]``.
        impl: see :func:`resolve_impl`.
    Returns:
        ``(states [B, T, N, H], final [B, N, H])``.
    """
    H, R = W1.shape[1:]
    impl = resolve_impl(impl, u, R, H)
    if impl == "reference":
        return reference_recurrence(CPTransition(W1, W2), u, h0, mask, chunk, offset, reset=reset, h_start=h_start)
    B, T, N = u.shape[:3]
    h0 = h0.expand(B, N, H)
    Mt = torch.einsum("nhr,nhs->nrs", W1, W2)  # M^T with M = W2^T W1
    p0 = torch.einsum("nhr,bnh->nbr", W2, h0).contiguous()  # p = W2^T h
    keep = u.new_empty(0, dtype=torch.bool) if mask is None else mask.bool().t().contiguous()
    restart, p_start = u.new_empty(0, dtype=torch.bool), u.new_empty(0)
    if reset is not None:
        restart = (reset.bool() if mask is None else reset.bool() & mask.bool()).t().contiguous()
        p_start = torch.einsum("nhr,nh->nr", W2, h_start).contiguous()
    # The factors permuted to the scan's [T, N, B, R], no copy (the scans read any strides with the rank contiguous);
    # G comes back sequence-major, so the einsum's per-head matmuls read it in place.
    G, _, _ = cp_scan(u.contiguous().permute(1, 2, 0, 3), Mt.contiguous(), p0, keep, W1.detach().contiguous(), chunk,
                      offset, restart, p_start, impl)
    states = torch.einsum("nhr,tnbr->btnh", W1, G)
    if mask is not None:
        # A padded position keeps the last unpadded state (h0 before any): gather it.
        positions = torch.arange(1, T + 1, device=u.device).expand(B, T)
        last = torch.where(mask.bool(), positions, 0).cummax(dim=1).values
        with_h0 = torch.cat([h0[:, None], states], dim=1)
        states = with_h0.gather(1, last[:, :, None, None].expand(-1, -1, *states.shape[2:]))
    return states, states[:, -1]


def recurrence(transition, factors, h0, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto",
               additive=None, reset=None, h_start=None):
    """Run a mixer's recurrence over a sequence: ``(states [B, T, N, H], final [B, N, H])``.

    ``transition``: a :class:`~.bilinear_reference.CPTransition` or any map ``(h, factors_t) -> A(x_t) h``; ``h_start``:
    ``[N, H]``; the other arguments as in :func:`~.bilinear_reference.reference_recurrence`, ``offset`` an int or a 0-d tensor
    (a static cache's count). A single position runs one :func:`~.bilinear_reference.reference_step` (its overflow guard on
    whenever ``chunk > 0``; a tensor offset makes its boundary test a tensor op, nothing for a compiled step to branch
    on), or for the CP map on CPU without gradients outside a compiled graph (eager decoding) the C++ ``cp_step``;
    longer sequences of the CP map without additive input run a rank-space scan, every other one the reference loop
    (both read a tensor offset on the host).
    """
    if impl not in IMPLS:
        raise ValueError(f"recurrence_impl must be one of {IMPLS}, got {impl!r}")
    B = factors.shape[0]
    cp_map = isinstance(transition, CPTransition) and additive is None
    if factors.shape[1] == 1:
        h = h0.expand(B, *h0.shape[-2:])
        keep_t, reset_t = None if mask is None else mask[:, 0], None if reset is None else reset[:, 0]
        boundary = is_boundary(chunk, offset, 0)  # a 0-d tensor where the offset is one (a static cache's count)
        if cp_map and _step_kernel_runs(impl, factors):  # the C++ step (eager decoding)
            h = load_cpu_kernels().cp_step(
                factors[:, 0].contiguous(), h.contiguous(), transition.W1.contiguous(), transition.W2.contiguous(),
                _step_flags(keep_t), _step_flags(reset_t), h if h_start is None else h_start.contiguous(),
                bool(boundary), chunk > 0, SAFE_MIN, SAFE_MAX)[0]
        else:  # in a compiled step: PyTorch ops, which Inductor fuses with the rest of the step
            h = reference_step(transition, factors[:, 0], h, keep_t, boundary, guard=chunk > 0,
                               additive_t=None if additive is None else additive[:, 0], reset_t=reset_t,
                               h_start=h_start)
        return h[:, None], h
    if isinstance(offset, torch.Tensor):
        offset = int(offset)  # a static cache's count, read on the host: the scans and the loop plan chunks with it
    if cp_map:
        return cp_recurrence(factors, transition.W1, transition.W2, h0, mask, chunk, offset, impl, reset, h_start)
    return reference_recurrence(transition, factors, h0, mask, chunk, offset, additive, reset, h_start)


def memory_recurrence(q, k, v, g, beta, memory, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto",
                      reset=None, keep: int = 0):
    """Run the memory heads over a sequence: ``(outputs [B, T, N, Dv], (S, c))`` as
    :func:`~.delta_rule_reference.reference_delta_rule` (same arguments; ``offset`` an int or a 0-d tensor).
    ``impl="reference"`` runs its loop; a single position runs one step: without gradients on CPU outside a compiled
    graph (eager decoding; fp32/fp64, the kernels loaded, ``impl`` auto or cpp) the C++ ``delta_rule_step``, else the
    loop's PyTorch step (in a compiled step Inductor fuses it with the rest of the step: faster than the kernel as a
    custom op there; a tensor offset stays a tensor, nothing to branch on); every other ``impl`` the chunked PyTorch
    form (``delta_rule_chunk.chunk_delta_rule``), on any device.

    ``keep``: the memory after each of the last ``keep`` positions too (a cache that can roll back), which run one
    step at a time as decoding does: ``S`` and ``c`` then have a positions dimension, ``[B, keep, N, Dv, Dk]`` and
    ``[B, keep, N]``."""
    if keep:
        T = q.shape[1]

        def part(x, t0, t1):
            return None if x is None else x[:, t0:t1]

        outputs, kept = [], []
        for t0, t1 in [(0, T - keep)] * (keep < T) + [(t, t + 1) for t in range(T - keep, T)]:
            q_, k_, v_, g_, beta_, mask_, reset_ = (part(x, t0, t1) for x in (q, k, v, g, beta, mask, reset))
            o, memory = memory_recurrence(q_, k_, v_, g_, beta_, memory, mask_, chunk, offset + t0, impl, reset_)
            outputs.append(o)
            kept.append(memory)
        S, c = zip(*kept[-keep:])
        return torch.cat(outputs, 1), (torch.stack(S, 1), torch.stack(c, 1))
    if q.shape[1] == 1 and _step_kernel_runs(impl, q):  # the C++ step (eager decoding)
        S, c, o = load_cpu_kernels().delta_rule_step(
            *(x[:, 0].contiguous() for x in (q, k, v, g, beta)), memory[0].contiguous(), memory[1].contiguous(),
            _step_flags(None if mask is None else mask[:, 0]), _step_flags(None if reset is None else reset[:, 0]),
            bool(is_boundary(chunk, offset, 0)))
        return o[:, None], (S, c)
    if impl == "reference" or q.shape[1] == 1:
        return reference_delta_rule(q, k, v, g, beta, memory, mask, chunk, offset, reset)
    return chunk_delta_rule(q, k, v, g, beta, memory, mask, chunk, int(offset), reset)
