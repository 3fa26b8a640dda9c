"""The one place that decides how a recurrence runs.

* :func:`recurrence` runs a sequence, ``(map, factors, h0, mask, chunk, offset, impl, ...) -> (states, final)``:
  a CP map (:class:`~.recurrence.CPTransition` or :class:`~.recurrence.CPWriteTransition`, no additive input) takes a
  rank-space scan, every other map the reference loop, and a single position (decoding) one
  :func:`~.recurrence.reference_step` (for a CP map on CPU without gradients, its compiled twin ``cp_step``).
  :func:`resolve_impl` picks the scan: ``"cpp"`` (the C++ CPU scan, ``bilinear_lm.kernels.cpu``, where the package
  is installed; CPU fp32/fp64), ``"triton"`` (``scan_triton``, CUDA; imported only when chosen), ``"torch"``
  (``scan``, any device) or ``"reference"`` (the loop itself).
* :func:`cp_recurrence` is the CP entry with the scan's signature ``(u, W1, W2, h0, mask, chunk, offset)``.
* :func:`linear` is how the modules apply their projections: a decoding step's few CPU rows take the compiled GEMV
  (the layers stay plain ``nn.Linear``, so adapters such as LoRA keep working).

The scans are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces through them.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from .recurrence import CPTransition, CPWriteTransition, is_boundary, reference_recurrence, reference_step
from .scan import scan_backward as torch_scan_backward
from .scan import scan_forward as torch_scan_forward

try:  # the compiled CPU kernels ship with the package; remote code (save_pretrained) runs PyTorch without them
    from bilinear_lm.kernels.cpu import load as load_cpu_kernels
    from bilinear_lm.kernels.cpu import loaded as loaded_cpu_kernels
except ImportError:
    load_cpu_kernels = loaded_cpu_kernels = None

IMPLS = ("auto", "cpp", "triton", "torch", "reference")


@torch.compiler.assume_constant_result
def cpu_kernels_available() -> bool:
    """Whether the C++ CPU kernels are built, or build now (once). ``torch.compile`` keeps the answer it traced."""
    return load_cpu_kernels is not None and load_cpu_kernels() is not None


def build_kernels(config, device_type: str) -> None:
    """Build now what ``config.recurrence_impl`` will compile on ``device_type`` (the C++ scan on CPU), so that the
    first training step (and its tokens/s) does not pay for the build. A no-op where nothing would be built (only
    the CP transitions, ``CP`` and its subclasses, without additive input run a scan)."""
    from .transitions import CP, TRANSITIONS  # here: transitions imports this module

    if device_type == "cpu" and config.recurrence_impl in ("auto", "cpp") \
            and issubclass(TRANSITIONS[config.mixer_type], CP) and not config.additive_input:
        cpu_kernels_available()


SMALL_BATCH_ROWS = 4  # decoding: up to this many rows take the GEMV


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, except that a plain ``nn.Linear`` (no hooks) on at most ``SMALL_BATCH_ROWS`` fp32/fp64 CPU rows
    without gradients or autocast, a decoding step's projection, runs the compiled GEMV when the kernels are built
    (2-3x ``F.linear`` on the CPUs measured; docs/results.md). Anything else, adapters such as LoRA included, is
    ``layer(x)``; this never builds the kernels."""
    if x.numel() > SMALL_BATCH_ROWS * x.shape[-1] or torch.is_grad_enabled() or type(layer) is not nn.Linear:
        return layer(x)  # the common cases first: this runs for every projection
    kernel = loaded_cpu_kernels() if loaded_cpu_kernels is not None else None
    weight = layer.weight
    if (kernel is None or x.device.type != "cpu" or x.dtype != weight.dtype
            or x.dtype not in (torch.float32, torch.float64) or layer.bias is not None
            or layer._forward_hooks or layer._forward_pre_hooks or torch.is_autocast_enabled("cpu")):
        return layer(x)
    y = kernel.small_batch_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous())
    return y.view(*x.shape[:-1], weight.shape[0])


def _cpu_kernels_run_on(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64) and cpu_kernels_available()


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
    from .scan_triton import available  # imported only here: CPU-only use never loads Triton

    return available(device_type)


def _scan_functions(impl: str):
    """``(scan_forward, scan_backward)`` of ``impl`` (remote code can import only ``from .module import name``)."""
    if impl == "cpp":
        kernel = load_cpu_kernels()
        return kernel.scan_forward, kernel.scan_backward
    if impl == "triton":
        from .scan_triton import scan_backward, scan_forward

        return scan_forward, scan_backward
    return torch_scan_forward, torch_scan_backward


# One library per copy of this module: the package and a remote-code copy of it may be imported side by side.
_NAMESPACE = re.sub(r"\W", "_", __name__.rpartition(".")[0])


@torch.library.custom_op(f"{_NAMESPACE}::cp_scan", mutates_args=())
def cp_scan(u: torch.Tensor, Mt: torch.Tensor, p0: torch.Tensor, keep: torch.Tensor, W1: torch.Tensor, chunk: int,
            offset: int, restart: torch.Tensor, p_start: torch.Tensor, columns: int, write: torch.Tensor,
            v: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank-space scan ``(G, P, S)`` of ``scan.scan_forward``, run by ``impl`` (torch, cpp or triton)."""
    return _scan_functions(impl)[0](u, Mt, W1, keep, p0, chunk, offset, restart, p_start, columns, write, v)


@cp_scan.register_fake
def _(u, Mt, p0, keep, W1, chunk, offset, restart, p_start, columns, write, v, impl):
    T, N, B, R = u.shape
    return torch.empty_like(u), u.new_empty(T + 1, N, B, R), u.new_empty(T, N, B, 1)


@torch.library.custom_op(f"{_NAMESPACE}::cp_scan_backward", mutates_args=())
def cp_scan_backward(dG: torch.Tensor, su: torch.Tensor, MtT: torch.Tensor, keep: torch.Tensor, restart: torch.Tensor,
                     write: torch.Tensor, e: torch.Tensor,
                     impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's reverse loop: ``(DGT, DP, dp0, dp_start)`` of ``scan.scan_backward``."""
    DGT, DP = torch.empty_like(su), torch.empty_like(su)
    dp0, dp_start = _scan_functions(impl)[1](dG, su, MtT, keep, restart, DGT, DP, write, e)
    return DGT, DP, dp0, dp_start


@cp_scan_backward.register_fake
def _(dG, su, MtT, keep, restart, write, e, impl):
    return torch.empty_like(su), torch.empty_like(su), su.new_empty(su.shape[1:]), su.new_empty(su.shape[1:])


def _cp_scan_setup_context(ctx, inputs, output):
    u, Mt, _, keep, _, _, _, restart, p_start, columns, write, _, impl = inputs
    G, P, S = output
    ctx.save_for_backward(u, Mt, keep, restart, p_start, write, G, P, S)
    ctx.impl, ctx.columns = impl, columns


def _from_log_form(grad, x):
    """``dL/dx`` from the log-form gradient ``x dL/dx`` (``scan``'s docstring); 0 where ``x`` is 0."""
    return torch.where(x != 0, grad / torch.where(x != 0, x, 1.0), 0.0)


def _cp_scan_backward_rule(ctx, dG, dP, dS):
    """Gradients of ``u``, ``Mt``, ``p0``, ``p_start`` and ``write`` (``P`` and ``S`` feed nothing differentiable, nor
    ``v``: it only sets the detached normalization). With the write, the last coordinate's gradients come from the
    scan in log form (``scan``'s docstring), so ``du`` and ``dMt`` hold no gradient in that coordinate: the caller's
    constant 1 in ``u`` and zero padding of ``Mt`` there discard it."""
    u, Mt, keep, restart, p_start, write, G, P, S = ctx.saved_tensors
    T = u.shape[0]
    su, e = S * u, G.new_empty(0)
    if write.numel():
        su[..., -1] = 1
        e = G[..., -1:].contiguous()
    DGT, DP, dp0, dp_start = cp_scan_backward(dG.contiguous(), su, Mt.transpose(1, 2).contiguous(), keep, restart,
                                              write, e, ctx.impl)
    du = S * P[:T] * DGT  # P[t] is step t's input: p_start at a restart
    dMt = torch.einsum("tnbr,tnbs->nrs", G, DP)
    if restart.numel():  # per row -> per column of the start state: [N, columns, R]
        dp_start = dp_start.unflatten(1, (-1, ctx.columns)).sum(1)
    dwrite = None
    if write.numel():  # p_t = g_t Mt + e_t [beta_t | gamma_t]: dL/dgamma_t = e_t dL/dc_t = (c_t dL/dc_t) / gamma_t
        dwrite = torch.cat([e * DP[..., :-1], _from_log_form(DP[..., -1:], write[..., -1:])], dim=-1)
        dp0[..., -1:] = _from_log_form(dp0[..., -1:], P[0][..., -1:])
        if restart.numel():
            dp_start[..., -1:] = _from_log_form(dp_start[..., -1:], p_start[..., -1:])
    return du, dMt, dp0, None, None, None, None, None, dp_start if restart.numel() else None, None, dwrite, None, None


cp_scan.register_autograd(_cp_scan_backward_rule, setup_context=_cp_scan_setup_context)


def cp_recurrence(u, W1, W2, h0, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto", reset=None,
                  h_start=None, columns: int = 1, write: bool = False):
    """The CP-factored recurrence, equal to ``reference_recurrence(CPTransition(W1, W2), u, h0, ...)``, or with
    ``write`` to ``reference_recurrence(CPWriteTransition(W1, W2), ...)``.

    Args:
        u: ``[B, T, N, R]`` input factors (with ``write``: ``[u | v | gamma]``, ``[B, T, N, R + H + 1]``).
        W1, W2: ``[N, H, R]``. h0: ``[N, H]`` or ``[B, N, H]`` (with ``write``: ``H + 1``, the last entry ``c``).
        mask, chunk, offset, reset: as in :func:`~.recurrence.reference_recurrence`.
        h_start: ``[N, H]``, or ``[columns, N, H]`` (the start of each column of a head's state).
        columns: rows per head state (``B = batch * columns``; ``recurrence``'s module docstring).
        impl: see :func:`resolve_impl`.
    Returns:
        ``(states [B, T, N, H], final [B, N, H])`` (``H + 1`` with ``write``).
    """
    H, R = W1.shape[1:]
    transition = CPWriteTransition(W1, W2) if write else CPTransition(W1, W2)
    impl = resolve_impl(impl, u, R + write, H + write)
    if impl == "reference":
        return reference_recurrence(transition, u, h0, mask, chunk, offset, reset=reset,
                                    h_start=_start_rows(h_start, u.shape[0], columns), columns=columns)
    B, T, N = u.shape[:3]
    h0 = h0.expand(B, N, h0.shape[-1])
    Mt = torch.einsum("nhr,nhs->nrs", W1, W2)  # M^T with M = W2^T W1

    def rank_space(h, pattern):  # p = W2^T h, or [W2^T h; c] with the write coordinate
        p = torch.einsum(pattern, W2, h[..., :W2.shape[1]])
        return torch.cat([p, h[..., -1:].movedim(-2, 0)], dim=-1) if write else p

    p0 = rank_space(h0, "nhr,bnh->nbr").contiguous()
    keep = u.new_empty(0, dtype=torch.bool) if mask is None else mask.bool().t().contiguous()
    restart, p_start = u.new_empty(0, dtype=torch.bool), u.new_empty(0)
    if reset is not None:
        restart = (reset.bool() if mask is None else reset.bool() & mask.bool()).t().contiguous()
        p_start = rank_space(h_start.reshape(-1, N, h0.shape[-1]), "nhr,pnh->npr").contiguous()
    write_t, v_t = u.new_empty(0), u.new_empty(0)
    if write:  # the last rank coordinate carries c (scan's module docstring)
        u, v, gamma = u.split([R, H, 1], dim=-1)
        write_t = torch.cat([torch.einsum("nhr,btnh->tnbr", W2, v), gamma.permute(1, 2, 0, 3)], dim=-1).contiguous()
        v_t = v.permute(1, 2, 0, 3).contiguous()
        u = torch.cat([u, torch.ones_like(gamma)], dim=-1)
        Mt, W1 = F.pad(Mt, (0, 1, 0, 1)), F.pad(W1, (0, 1))
    G, _, _ = cp_scan(u.permute(1, 2, 0, 3).contiguous(), Mt.contiguous(), p0, keep, W1.detach().contiguous(), chunk,
                      offset, restart, p_start, columns, write_t, v_t, impl)
    states = torch.einsum("nhr,tnbr->btnh", W1, G)
    if write:  # [h; c] = [W1 g + v e; gamma e]
        e = G[..., -1:].permute(2, 0, 1, 3)
        states = torch.cat([states + v * e, gamma * e], dim=-1)
    if mask is not None:
        # A padded position keeps the last unpadded state (h0 before any): gather it.
        positions = torch.arange(1, T + 1, device=u.device).expand(B, T)
        last = torch.where(mask.bool(), positions, 0).cummax(dim=1).values
        with_h0 = torch.cat([h0[:, None], states], dim=1)
        states = with_h0.gather(1, last[:, :, None, None].expand(-1, -1, *states.shape[2:]))
    return states, states[:, -1]


def _start_rows(h_start, rows: int, columns: int):
    """``h_start`` (``[N, H]`` or ``[columns, N, H]``) as every row's start, ``[rows, N, H]`` (None stays None)."""
    if h_start is None:
        return None
    return h_start.reshape(-1, *h_start.shape[-2:]).repeat(rows // columns, 1, 1)


def recurrence(transition, factors, h0, mask=None, chunk: int = 64, offset: int = 0, impl: str = "auto",
               additive=None, reset=None, h_start=None, columns: int = 1):
    """Run a mixer's recurrence over a sequence: ``(states [B, T, N, H], final [B, N, H])``.

    ``transition``: a :class:`~.recurrence.CPTransition`, :class:`~.recurrence.CPWriteTransition` or any map
    ``(h, factors_t) -> A(x_t) h``; ``h_start``: ``[N, H]`` or ``[columns, N, H]``; ``columns``: rows per head state
    (``B = batch * columns``); the other arguments as in :func:`~.recurrence.reference_recurrence`. A single position
    runs one :func:`~.recurrence.reference_step` (its overflow guard on whenever ``chunk > 0``), or for the CP maps on
    CPU without gradients (decoding) the compiled ``cp_step``; longer sequences of the CP maps without additive input
    run a rank-space scan, every other one the reference loop.
    """
    if impl not in IMPLS:
        raise ValueError(f"recurrence_impl must be one of {IMPLS}, got {impl!r}")
    B = factors.shape[0]
    cp_map = isinstance(transition, (CPTransition, CPWriteTransition)) and additive is None
    if factors.shape[1] == 1:
        h = h0.expand(B, *h0.shape[-2:])
        keep_t, reset_t = None if mask is None else mask[:, 0], None if reset is None else reset[:, 0]
        if cp_map and not torch.is_grad_enabled() and impl in ("auto", "cpp") \
                and _cpu_kernels_run_on(factors):  # the compiled step (decoding)
            transition = transition.as_cp() if isinstance(transition, CPWriteTransition) else transition
            empty = torch.empty(0, dtype=torch.bool)
            h = load_cpu_kernels().cp_step(
                factors[:, 0].contiguous(), h.contiguous(), transition.W1.contiguous(), transition.W2.contiguous(),
                empty if keep_t is None else keep_t.bool().contiguous(),
                empty if reset_t is None else reset_t.bool().contiguous(),
                h if h_start is None else h_start.reshape(-1, *h.shape[-2:]).contiguous(),
                is_boundary(chunk, offset, 0), chunk > 0, columns)[0]
        else:
            h = reference_step(transition, factors[:, 0], h, keep_t, is_boundary(chunk, offset, 0), guard=chunk > 0,
                               additive_t=None if additive is None else additive[:, 0], reset_t=reset_t,
                               h_start=_start_rows(h_start, B, columns), columns=columns)
        return h[:, None], h
    if cp_map:
        return cp_recurrence(factors, transition.W1, transition.W2, h0, mask, chunk, offset, impl, reset, h_start,
                             columns, isinstance(transition, CPWriteTransition))
    return reference_recurrence(transition, factors, h0, mask, chunk, offset, additive, reset,
                                _start_rows(h_start, B, columns), columns)
