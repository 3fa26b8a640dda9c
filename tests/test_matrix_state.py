"""The matrix-valued state (``state_columns > 1``) against independent references: the outer-product recurrence
written out in fp64 without normalization, every chunk size, every scan, the decoding step and a column-wise
reference loop."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling.dispatch import cp_recurrence, recurrence
from bilinear_lm.modeling.modeling_bilinear import BilinearMixer
from bilinear_lm.modeling.recurrence import CPTransition, CPWriteTransition, cp_transition, reference_recurrence, \
    reference_step

IMPLS = ["reference", "torch", "cpp"]


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def matrix_mixer(impl="auto", chunk=3, P=4, **changes):
    cfg = BilinearConfig(vocab_size=11, hidden_size=12, num_heads=2, state_size=5, rank=3, norm_chunk_size=chunk,
                         write_channel=True, state_columns=P, input_factor_init_std=0.5, recurrence_impl=impl,
                         **changes)
    torch.manual_seed(0)
    mixer = BilinearMixer(cfg, 0)
    mixer.reset_parameters()
    with torch.no_grad():
        mixer.h_start.mul_(torch.rand_like(mixer.h_start) + 0.5)  # columns and c of different sizes
    return mixer.double()


def outer_product_loop(mixer, x, mask):
    """``S_t = A(x_t) S_{t-1} + b(x_t) k(x_t)^T c_{t-1}``, ``c_t = gamma(x_t) c_{t-1}``, ``y = StateNorm(S q)``, gated,
    projected: the mixer's definition, one position and one head at a time, never normalized (c per column as
    ``h_start`` holds it)."""
    cfg, tr = mixer.config, mixer.transition
    N, H, P = cfg.num_heads, cfg.state_size, cfg.state_columns
    R = 0 if cfg.mixer_type == "identity" else cfg.rank  # identity: no input factors, A = I
    raw, gate, _, query = mixer.in_proj(x).split(mixer.split_sizes, dim=-1)
    raw = raw.view(*x.shape[:2], N, -1)
    u = raw[..., :R] + tr.factor_bias if R else None
    b, gamma, k = raw[..., R:R + H], raw[..., R + H].exp(), F.normalize(raw[..., R + H + 1:], dim=-1)
    q = query.view(*x.shape[:2], N, P)
    start = mixer.h_start.view(N, P, H + 1)
    ys = []
    for row in range(x.shape[0]):
        S, c = start[..., :H].transpose(1, 2), start[..., H]  # [N, H, P], [N, P]
        for t in range(x.shape[1]):
            if mask[row, t]:
                A = torch.einsum("nir,nr,njr->nij", tr.W1, u[row, t], tr.W2) if R else torch.eye(H, dtype=x.dtype)
                S = A @ S + b[row, t, :, :, None] * (k[row, t] * c)[:, None, :]
                c = gamma[row, t, :, None] * c
            ys.append(torch.einsum("nhp,np->nh", S, q[row, t]))
    y = mixer.state_norm(torch.stack(ys).view(*x.shape[:2], N, H)).flatten(2) * F.silu(gate)
    return mixer.out_proj(y)


@pytest.mark.parametrize("mixer_type", ["cp", "identity"])
@pytest.mark.parametrize("impl", IMPLS)
def test_the_mixer_is_the_outer_product_recurrence(impl, mixer_type):
    """Outputs and every parameter's gradient equal the unnormalized outer-product loop (the normalization every 3
    positions and the padding must change nothing); ``identity`` is gated linear attention, ``A = I``."""
    mixer = matrix_mixer(impl, mixer_type=mixer_type)
    x = torch.randn(3, 8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0
    y, states, final = mixer(x, mask=mask, offset=1)
    expected = outer_product_loop(mixer, x, mask)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
    assert states.shape == (3, 8, 2, 4 * 6) and final.shape == (3, 2, 4 * 6)
    probe = torch.randn_like(y)
    params = list(mixer.parameters())
    got = torch.autograd.grad((y * probe).sum(), params)
    want = torch.autograd.grad((expected * probe).sum(), params)
    for (name, _), g, w in zip(mixer.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-11, msg=name)


def test_every_chunk_size_gives_the_same_logits():
    """One scalar renormalizes a head's whole state (all its columns and c): every interval gives the same logits."""
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(2))
    logits = []
    for chunk in (0, 1, 5, 64):
        config = BilinearConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_heads=2, state_size=4,
                                rank=4, write_channel=True, state_columns=8, norm_chunk_size=chunk)
        torch.manual_seed(0)
        logits.append(BilinearForCausalLM(config).double()(ids).logits)
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-10, atol=1e-10)


def column_case(B=3, T=41, N=2, H=5, R=6, P=4, dtype=torch.float64, growth=1.0):
    g = torch.Generator().manual_seed(5)
    u = ((1 + 0.5 * torch.randn(B * P, T, N, R, generator=g, dtype=dtype)) * growth).requires_grad_()
    W1 = torch.randn(N, H, R, generator=g, dtype=dtype).div(R ** 0.5).requires_grad_()
    W2 = torch.randn(N, H, R, generator=g, dtype=dtype).div(H ** 0.5).requires_grad_()
    h0 = torch.randn(B * P, N, H, generator=g, dtype=dtype).requires_grad_()
    h_start = torch.randn(P, N, H, generator=g, dtype=dtype).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [t for t in (5, 6, 30) if t < T]] = reset[2, [0, min(17, T - 1)]] = True
    return u, W1, W2, h0, h_start, mask.repeat_interleave(P, 0), reset.repeat_interleave(P, 0)


def unit_per_head(states, P):
    """Each head's state over all its columns (rows ``b * P + j``) scaled to unit norm."""
    grouped = states.unflatten(0, (-1, P))
    return (grouped / grouped.pow(2).sum(dim=(1, -1), keepdim=True).sqrt()).flatten(0, 1)


@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_column_scans_equal_the_reference_loop_with_every_gradient(impl):
    """Columns as rows with shared weights, padding, restarts from each column's start, normalization every 4."""
    u, W1, W2, h0, h_start, mask, reset = column_case()
    inputs = [u, W1, W2, h0, h_start]
    results = [cp_recurrence(u, W1, W2, h0, mask, 4, 1, i, reset, h_start, columns=4) for i in (impl, "reference")]
    weights = torch.randn_like(results[0][0])
    grads = [torch.autograd.grad((s * weights).sum() + f.sum(), inputs) for s, f in results]
    assert relative_error(results[0][0], results[1][0]) < 1e-11
    for name, got, want in zip(["u", "W1", "W2", "h0", "h_start"], *grads):
        assert relative_error(got, want) < 1e-10, name


def write_case(P=4, **kw):
    """:func:`column_case` with the write channel: factors ``[u | v | gamma]`` (``v``: each column's write), states
    ``[h; c]``."""
    u, W1, W2, h0, h_start, mask, reset = column_case(P=P, **kw)
    g = torch.Generator().manual_seed(6)
    extend = lambda x, *extra: torch.cat([x.detach(), *extra], dim=-1).requires_grad_()
    f = extend(u, torch.randn(*u.shape[:-1], W1.shape[1], generator=g, dtype=u.dtype),
               torch.rand(*u.shape[:-1], 1, generator=g, dtype=u.dtype) + 0.5)
    h0 = extend(h0, torch.rand(*h0.shape[:-1], 1, generator=g, dtype=u.dtype) + 0.5)
    h_start = extend(h_start, torch.rand(*h_start.shape[:-1], 1, generator=g, dtype=u.dtype) + 0.5)
    return f, W1, W2, h0, h_start, mask, reset


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_write_scans_equal_the_reference_loop_with_every_gradient(impl, P):
    """The write as the scans' extra rank-space coordinate against the loop over ``[h; c]``, and that loop against
    the same map as CP factors of rank ``R + H + 1`` (``as_cp``: what the Triton scan and decoding run)."""
    f, W1, W2, h0, h_start, mask, reset = write_case(P=P)
    inputs = [f, W1, W2, h0, h_start]
    results = [cp_recurrence(f, W1, W2, h0, mask, 4, 1, i, reset, h_start, P, write=True) for i in (impl, "reference")]
    results.append(reference_recurrence(CPWriteTransition(W1, W2).as_cp(), f, h0, mask, 4, 1, reset=reset,
                                        h_start=h_start.repeat(3, 1, 1), columns=P))
    weights = torch.randn_like(results[0][0])
    grads = [torch.autograd.grad((s * weights).sum() + f.sum(), inputs) for s, f in results]
    for k in (0, 2):
        assert relative_error(results[k][0], results[1][0]) < 1e-11
        for name, got, want in zip(["f", "W1", "W2", "h0", "h_start"], grads[k], grads[1]):
            assert relative_error(got, want) < 1e-10, name


@pytest.mark.parametrize("impl", ["torch", "cpp", "triton"])
def test_fp32_write_gradients_stay_finite_where_c_falls_to_the_bottom_of_fp32(impl):
    """The write coordinate ``c`` falls 37 orders of magnitude below ``h`` (``gamma = 0.055`` for 30 steps), then
    climbs back above it (``gamma = 1e4``): ``dL/dc`` at the bottom is ~1e39, past fp32's range, though every
    gradient of the loss is moderate. The scans' backward in fp32 (the write coordinate in log form) against the
    fp64 reference loop."""
    if impl == "triton":
        pytest.importorskip("triton")
    f, W1, W2, h0, _, _, _ = write_case(P=1, T=40)
    with torch.no_grad():
        f[..., -1] = torch.where(torch.arange(40)[:, None] < 30, 0.055, 1e4)
    inputs = [f, W1, W2, h0]
    weights = 30 * torch.randn(f.shape[0], 40, *h0.shape[1:], generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64)
    grads = []
    for i, dtype in ((impl, torch.float32), ("reference", torch.float64)):
        states, _ = cp_recurrence(*(x.to(dtype) for x in inputs), None, 8, 0, i, write=True)
        loss = (unit_per_head(states.double(), 1) * weights).sum()
        grads.append(torch.autograd.grad(loss, inputs))
    for name, got, want in zip(["f", "W1", "W2", "h0"], *grads):
        assert torch.isfinite(got).all(), name
        assert relative_error(got, want) < 1e-3, name


@pytest.mark.parametrize("write", [False, True])
@pytest.mark.parametrize("impl", ["reference", "torch", "cpp"])
def test_the_guard_keeps_a_heads_columns_in_proportion(impl, write):
    """A transition growing 10^4-fold per step: the guard renormalizes a head's columns together, so the per-head
    unit state equals the unguarded fp64 run's (no chunked normalization at all: 1e4^30 squared stays in fp64's range)."""
    u, W1, W2, h0, h_start, mask, reset = (write_case if write else column_case)(T=30, growth=1e4)
    guarded, _ = cp_recurrence(u.float(), W1.float(), W2.float(), h0.float(), mask, 64, 0, impl, columns=4,
                               write=write)
    exact, _ = reference_recurrence((CPWriteTransition if write else CPTransition)(W1, W2), u, h0, mask, 0, 0,
                                    columns=4)
    assert torch.isfinite(guarded).all()
    assert relative_error(unit_per_head(guarded.double(), 4), unit_per_head(exact, 4)) < 1e-4


@pytest.mark.parametrize("write", [False, True])
def test_the_decoding_step_of_columns_equals_the_reference_step(write):
    """One position without gradients (the compiled ``cp_step`` where it builds; the write channel as CP factors
    there) against ``reference_step``, at a boundary, with the guard, a padded row and a restart."""
    case = write_case(T=1) if write else column_case(T=1)  # restarts at the first position of row 2
    u, W1, W2, h0, h_start, mask, reset = (t.detach() for t in case)
    transition = (CPWriteTransition if write else CPTransition)(W1, W2)
    h0[8:] *= 1e14  # the third row's columns leave the safe range together
    for boundary_offset in (0, 3):  # chunk 4: offset 3 ends a chunk
        with torch.no_grad():
            got, _ = recurrence(transition, u, h0, mask, 4, boundary_offset, "auto", reset=reset, h_start=h_start,
                                columns=4)
            want = reference_step(transition, u[:, 0], h0, mask[:, 0], boundary_offset == 3, True,
                                  reset_t=reset[:, 0], h_start=h_start.repeat(3, 1, 1), columns=4)
        torch.testing.assert_close(got[:, 0], want, rtol=1e-12, atol=1e-12)


def test_columns_need_a_power_of_two_and_no_additive_input():
    with pytest.raises(ValueError, match="state_columns must be a power of two"):
        BilinearConfig(state_columns=3)
    with pytest.raises(ValueError, match="works without additive_input"):
        BilinearConfig(additive_input=True, state_columns=4)
