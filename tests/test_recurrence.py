"""The recurrences against independent references: explicit transition matrices, and fast path vs loop."""

from functools import partial

import pytest
import torch

from bilinear_lm import BilinearConfig
from bilinear_lm.modeling import dispatch
from bilinear_lm.modeling.configuration_bilinear import MIXER_TYPES, RECURRENCE_IMPLS
from bilinear_lm.modeling.modeling_bilinear import BilinearMixer
from bilinear_lm.modeling.dispatch import cp_recurrence, recurrence
from bilinear_lm.modeling.transitions import TRANSITIONS
from bilinear_lm.modeling.bilinear_reference import CPTransition, cp_transition, reference_recurrence, reference_step
from bilinear_lm.modeling.chunked_normalization import is_boundary


def explicit_matrix_loop(matrices, h0, mask, chunk, offset):
    """Textbook loop: h_t = A_t h_{t-1} with the transition matrices built explicitly ([B, T, N, H, H])."""
    B, T = matrices.shape[:2]
    h = h0.expand(B, *h0.shape[-2:]).clone()
    out = []
    for t in range(T):
        for b in range(B):
            if mask is None or mask[b, t]:
                h[b] = torch.einsum("nij,nj->ni", matrices[b, t], h[b])
                if chunk and (offset + t + 1) % chunk == 0:
                    h[b] = h[b] / h[b].norm(dim=-1, keepdim=True)
        out.append(h.clone())
    return torch.stack(out, 1)


def make_inputs(B, T, N, H, R, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = (1 + 0.5 * torch.randn(B, T, N, R, generator=g, dtype=dtype)).requires_grad_()
    W1 = torch.randn(N, H, R, generator=g, dtype=dtype).div(R ** 0.5).requires_grad_()
    W2 = torch.randn(N, H, R, generator=g, dtype=dtype).div(H ** 0.5).requires_grad_()
    h0 = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    return u, W1, W2, h0


def random_mask(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[0, : T // 2] = 0  # a left-padded row
    return mask


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_cp_reference_equals_explicit_matrices():
    B, T, N, H, R = 2, 9, 2, 3, 5
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float64)
    mask = random_mask(B, T)
    A = torch.einsum("nir,btnr,njr->btnij", W1, u, W2)
    states, final = reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, h0, mask, chunk=4, offset=1)
    expected = explicit_matrix_loop(A, h0, mask, chunk=4, offset=1)
    torch.testing.assert_close(states, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, expected[:, -1], rtol=1e-12, atol=1e-12)


IMPLS = ["torch", "cpp"]


@pytest.mark.parametrize("impl", IMPLS)
def test_single_step_equals_explicit_matrices(impl):
    """T = 1 (decoding) through each scan, and through the step the decoding modules take, from a per-row state."""
    B, N, H, R = 3, 2, 5, 7
    u, W1, W2, _ = make_inputs(B, 1, N, H, R, torch.float64)
    h = torch.randn(B, N, H, dtype=torch.float64)
    mask = torch.tensor([[1], [0], [1]])
    A = torch.einsum("nir,btnr,njr->btnij", W1, u, W2)
    for chunk, offset in [(0, 0), (4, 3), (4, 1)]:  # (4, 3): the step ends a chunk and normalizes
        expected = explicit_matrix_loop(A, h, mask, chunk, offset)
        states, final = cp_recurrence(u, W1, W2, h, mask, chunk, offset, impl)
        torch.testing.assert_close(states, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final, expected[:, 0], rtol=1e-12, atol=1e-12)
        stepped = reference_step(CPTransition(W1, W2), u[:, 0], h, mask[:, 0], is_boundary(chunk, offset, 0))
        torch.testing.assert_close(stepped, expected[:, 0], rtol=1e-12, atol=1e-12)
        dispatched, _ = recurrence(CPTransition(W1, W2), u, h, mask, chunk, offset, impl)  # what decoding runs
        torch.testing.assert_close(dispatched, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T", [1, 63, 65])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk,offset", [(0, 0), (1, 0), (16, 5)])
def test_cp_fast_path_matches_reference_fp64(impl, T, masked, chunk, offset):
    B, N, H, R = 3, 3, 5, 7  # not powers of two; rank > state
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float64)
    mask = random_mask(B, T) if masked else None
    ref_states, ref_final = reference_recurrence(
        partial(cp_transition, W1=W1, W2=W2), u, h0, mask, chunk, offset)
    fast_states, fast_final = cp_recurrence(u, W1, W2, h0, mask, chunk, offset, impl)
    assert relative_error(fast_states, ref_states) < 1e-11
    assert relative_error(fast_final, ref_final) < 1e-11
    w_states, w_final = torch.randn_like(ref_states), torch.randn_like(ref_final)
    inputs = [u, W1, W2, h0]
    grads_ref = torch.autograd.grad((ref_states * w_states).sum() + (ref_final * w_final).sum(), inputs)
    grads_fast = torch.autograd.grad((fast_states * w_states).sum() + (fast_final * w_final).sum(), inputs)
    for name, gf, gr in zip(["u", "W1", "W2", "h0"], grads_fast, grads_ref):
        assert relative_error(gf, gr) < 1e-10, name


@pytest.mark.parametrize("H,R", [(83, 115), (64, 48), (96, 96)])
def test_cpp_scan_register_blocks_match_reference_fp64(H, R):
    """The C++ scan multiplies in column blocks of 64, 32, 16 and 1: sizes that take every block (115 = 64 + 32 + 16
    + 3, and the shapes the presets use), with masks, restarts and chunked normalization, forward and gradients."""
    B, T, N = 2, 21, 2
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float64)
    mask, reset = random_mask(B, T), torch.rand(B, T, generator=torch.Generator().manual_seed(3)) < 0.1
    h_start = torch.randn(N, H, dtype=torch.float64)
    ref_states, ref_final = reference_recurrence(CPTransition(W1, W2), u, h0, mask, 4, 1, reset=reset, h_start=h_start)
    fast_states, fast_final = cp_recurrence(u, W1, W2, h0, mask, 4, 1, "cpp", reset, h_start)
    assert relative_error(fast_states, ref_states) < 1e-11
    assert relative_error(fast_final, ref_final) < 1e-11
    w = torch.randn_like(ref_states)
    for gf, gr in zip(torch.autograd.grad((fast_states * w).sum(), [u, W1, W2, h0]),
                      torch.autograd.grad((ref_states * w).sum(), [u, W1, W2, h0])):
        assert relative_error(gf, gr) < 1e-10


@pytest.mark.parametrize("impl", IMPLS)
def test_cp_fast_path_matches_reference_fp32_batched_initial_state(impl):
    B, T, N, H, R = 4, 50, 2, 6, 3  # rank < state, initial state per row (as from a cache)
    u, W1, W2, _ = make_inputs(B, T, N, H, R, torch.float32)
    h0 = torch.randn(B, N, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    mask = random_mask(B, T)
    ref_states, ref_final = reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, h0, mask, 8, 0)
    fast_states, fast_final = cp_recurrence(u, W1, W2, h0, mask, 8, 0, impl)
    assert relative_error(fast_states, ref_states) < 1e-4
    loss_ref = ref_states.square().sum(-1).sqrt().sum()
    loss_fast = fast_states.square().sum(-1).sqrt().sum()
    for gf, gr in zip(torch.autograd.grad(loss_fast, [u, W1, W2, h0]), torch.autograd.grad(loss_ref, [u, W1, W2, h0])):
        assert relative_error(gf, gr) < 1e-3


@pytest.mark.parametrize("mixer_type", list(TRANSITIONS))
def test_every_transition_type_follows_its_transition_matrices(mixer_type):
    """Each registered type's recurrence (the mixer's forward: factors, map, dispatch, chunked normalization, padding)
    against the textbook loop over the matrices the class writes out itself (:meth:`Transition.matrices`), in fp64."""
    cfg = BilinearConfig(vocab_size=11, hidden_size=12, num_heads=2, state_size=6, rank=5, block_size=3,
                         mixer_type=mixer_type, norm_chunk_size=3, input_factor_init_std=0.5)
    mixer = BilinearMixer(cfg, 0).double()
    mixer.reset_parameters()
    mixer.double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    mask = random_mask(2, 7)
    with torch.no_grad():
        y, _, final, _, _ = mixer(x, mask=mask, offset=2)
        factors = mixer.transition.factors(mixer.in_proj(x)[..., : mixer.split_sizes[0]].view(2, 7, 2, -1))
        states = explicit_matrix_loop(mixer.transition.matrices(factors), mixer.h_start, mask, 3, 2)
    torch.testing.assert_close(final, states[:, -1], rtol=1e-10, atol=1e-12)
    normed = states / states.norm(dim=-1, keepdim=True) * 6 ** 0.5
    gate = torch.nn.functional.silu(mixer.in_proj(x)[..., mixer.split_sizes[0]:].detach())
    expected = mixer.out_proj(normed.flatten(2) * gate)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)


def test_explicit_matrices_of_the_structured_types():
    """The matrices the tests trust, checked against their definitions: block-diagonal zero off its blocks, rotation
    blocks ``[[a, -c], [c, a]]``, the positive diagonal in (0, 1), and CP equal to ``W1 diag(u) W2^T``."""
    cfg = dict(vocab_size=11, hidden_size=12, num_heads=2, state_size=6, rank=5, block_size=3)
    u = torch.randn(4, 2, 5, dtype=torch.float64)
    cp = TRANSITIONS["cp"](BilinearConfig(**cfg)).double()
    cp.reset_parameters()
    cp.double()
    want = torch.stack([torch.stack([cp.W1[n] @ torch.diag(u[b, n]) @ cp.W2[n].T for n in range(2)])
                        for b in range(4)])
    torch.testing.assert_close(cp.matrices(u), want)
    block = TRANSITIONS["block_diagonal"](BilinearConfig(**cfg, mixer_type="block_diagonal")).double()
    block.reset_parameters()
    block.double()
    A = block.matrices(u)
    assert (A[..., :3, 3:] == 0).all() and (A[..., 3:, :3] == 0).all()
    torch.testing.assert_close(A[..., 3:, 3:], torch.einsum("nijk,bnk->bnij", block.W[:, 1], u))
    v = torch.randn(4, 2, 6, dtype=torch.float64)
    R = TRANSITIONS["rotation"](BilinearConfig(**cfg, mixer_type="rotation")).matrices(v)
    a, c = v[..., 2], v[..., 3]
    torch.testing.assert_close(R[..., 2:4, 2:4], torch.stack([torch.stack([a, -c], -1), torch.stack([c, a], -1)], -2))
    assert (R[..., 0:2, 2:] == 0).all()
    positive = TRANSITIONS["positive_diagonal"](BilinearConfig(**cfg, mixer_type="positive_diagonal"))
    positive.reset_parameters()
    factors = positive.factors(v.float())
    assert (factors > 0).all() and (factors < 1).all()


def test_mixer_types_name_the_registry():
    """The config validates ``mixer_type`` against names (it imports no modeling machinery): they must be the
    registry's, and each type's own checks run when it is built."""
    assert MIXER_TYPES == tuple(TRANSITIONS)
    assert RECURRENCE_IMPLS == dispatch.IMPLS
    with pytest.raises(ValueError, match=r"state_size \(5\) must be divisible by block_size \(2\)"):
        TRANSITIONS["block_diagonal"](BilinearConfig(mixer_type="block_diagonal", state_size=5, rank=5))
    with pytest.raises(ValueError, match=r"state_size \(5\) must be even for mixer_type='rotation'"):
        TRANSITIONS["rotation"](BilinearConfig(mixer_type="rotation", state_size=5, rank=5))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("growth", [1e4, 1e-4])
def test_overflow_guard_keeps_states_finite_and_equal_up_to_scale(impl, growth):
    """A transition that grows (or shrinks) the state 10^4-fold per step would leave fp32 within a chunk of 64."""
    B, T, N, H, R = 2, 150, 2, 4, 4
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float32)
    u = (u.detach() * growth).requires_grad_()
    ref_states, _ = reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, h0, None, 64, 0)
    fast_states, _ = cp_recurrence(u, W1, W2, h0, None, 64, 0, impl)
    assert torch.isfinite(ref_states).all() and torch.isfinite(fast_states).all()
    unit = lambda s: s / s.norm(dim=-1, keepdim=True)  # the state is defined up to a positive per-head factor
    assert relative_error(unit(fast_states), unit(ref_states)) < 1e-3
    # A loss of the unit states is invariant to the detached per-head factors, so its gradients must agree too.
    weights = torch.randn_like(ref_states)
    grads = [torch.autograd.grad((unit(s) * weights).sum(), [u, W1, W2, h0]) for s in (ref_states, fast_states)]
    for name, gr, gf in zip(["u", "W1", "W2", "h0"], *grads):
        assert torch.isfinite(gf).all() and relative_error(gf, gr) < 1e-3, name


def test_compiled_kernel_and_torch_scan_agree_exactly_in_fp64():
    B, T, N, H, R = 5, 130, 3, 6, 9
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float64, seed=4)
    mask = random_mask(B, T)
    outs = [cp_recurrence(u, W1, W2, h0, mask, 16, 3, impl)[0] for impl in IMPLS]
    assert relative_error(outs[1], outs[0]) < 1e-13


@pytest.mark.parametrize("impl", IMPLS)
def test_scan_ops_pass_opcheck_with_the_layouts_the_mixer_gives_them(impl):
    """The two custom ops as the mixer calls them (the factors permuted, not copied; the gradient of ``G``
    sequence-major, as the einsum returns it; padding and restarts): schema, autograd registration, and fake
    implementations whose shapes and strides equal the real outputs' (``torch.compile`` plans with the fakes)."""
    T, N, B, R, H = 9, 2, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    u = (1 + 0.3 * torch.randn(B, T, N, R, generator=g, dtype=torch.float64)).permute(1, 2, 0, 3).requires_grad_()
    W1 = torch.randn(N, H, R, generator=g, dtype=torch.float64)
    Mt, p0, p_start = (torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
                       for shape in ((N, R, R), (N, B, R), (N, R)))
    keep = torch.rand(T, B, generator=g) > 0.2
    restart = (torch.rand(T, B, generator=g) > 0.7) & keep
    args = (u, Mt, p0, keep, W1, 4, 1, restart, p_start, impl)
    torch.library.opcheck(dispatch.cp_scan, args)
    with torch.no_grad():
        G, P, S = dispatch.cp_scan(*args)
    dG = torch.randn(N, B, T, R, generator=g, dtype=torch.float64).permute(2, 0, 1, 3)
    torch.library.opcheck(dispatch.cp_scan_backward, (dG, u.detach(), S, P, p0.detach(), p_start.detach(),
                                                      Mt.detach().transpose(1, 2).contiguous(), keep, restart, impl))


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_reset_equals_running_the_documents_separately(impl):
    """Document boundaries: at a reset the step starts from ``h_start``. Each document run alone from ``h_start`` (the
    first from ``h0``) must give the same states up to the per-head scale, and every gradient (``h_start`` included)
    must match the reference loop's."""
    B, T, N, H, R = 3, 40, 2, 5, 6
    u, W1, W2, h0 = make_inputs(B, T, N, H, R, torch.float64)
    h_start = torch.randn(N, H, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [5, 6, 30]] = True  # two documents in a row, one of length 1
    reset[2, [0, 17]] = True  # a reset at the first position
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0  # left padding, no reset
    states, final = cp_recurrence(u, W1, W2, h0, mask, 16, 3, impl, reset=reset, h_start=h_start)
    unit = lambda s: s / s.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        for b in range(B):
            starts = [0, *[t for t in range(T) if reset[b, t] and t > 0], T]
            for t0, t1 in zip(starts[:-1], starts[1:]):
                first = h_start if reset[b, t0] else h0
                alone, _ = reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u[b:b + 1, t0:t1], first,
                                                mask[b:b + 1, t0:t1], 16, 3 + t0)
                torch.testing.assert_close(unit(states[b:b + 1, t0:t1]), unit(alone), rtol=1e-10, atol=1e-12)
    ref_states, ref_final = reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, h0, mask, 16, 3,
                                                 reset=reset, h_start=h_start)
    weights = torch.randn_like(ref_states)
    inputs = [u, W1, W2, h0, h_start]
    grads = [torch.autograd.grad((s * weights).sum() + f.sum(), inputs) for s, f in
             ((ref_states, ref_final), (states, final))]
    for name, gr, gf in zip(["u", "W1", "W2", "h0", "h_start"], *grads):
        assert relative_error(gf, gr) < 1e-10, name


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_decoding_step_equals_the_reference_step(dtype, tol, monkeypatch):
    """Decoding (one position, no gradients) of the CP map runs the C++ ``cp_step``: equal to ``reference_step`` with
    padding, restarts, a chunk boundary and the overflow guard (one row far out of range), at sizes that take every
    column block of its vector-matrix products (115 = 64 + 32 + 16 + 3, 48 = 32 + 16)."""
    if dispatch.load_cpu_kernels is None or dispatch.load_cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    B, N, H, R = 4, 2, 115, 48
    u, W1, W2, _ = (t.detach() for t in make_inputs(B, 1, N, H, R, dtype))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, N, H, generator=g, dtype=dtype)
    h[3] *= 1e14  # its next state leaves the safe range: the guard normalizes it
    h_start = torch.randn(N, H, generator=g, dtype=dtype)
    mask, reset = torch.tensor([[1], [0], [1], [1]]), torch.tensor([[0], [1], [1], [0]], dtype=torch.bool)
    steps = []
    kernel = dispatch.load_cpu_kernels()
    monkeypatch.setattr(dispatch, "load_cpu_kernels", lambda: type("Spy", (), {
        "cp_step": lambda self, *args: steps.append(1) or kernel.cp_step(*args)})())
    for chunk, offset in [(0, 0), (4, 3), (4, 1)]:  # no normalization; the step ends a chunk; the guard alone
        with torch.no_grad():
            got, final = recurrence(CPTransition(W1, W2), u, h, mask, chunk, offset, "auto", reset=reset,
                                    h_start=h_start)
        want = reference_step(CPTransition(W1, W2), u[:, 0], h, mask[:, 0], is_boundary(chunk, offset, 0),
                              guard=chunk > 0, reset_t=reset[:, 0], h_start=h_start)
        scale = want.abs().amax(-1, keepdim=True)  # each (row, head) at its own scale: row 3 is 1e14 times larger
        torch.testing.assert_close(got[:, 0] / scale, want / scale, rtol=tol, atol=tol)
        torch.testing.assert_close(final / scale, want / scale, rtol=tol, atol=tol)
    assert len(steps) == 3
