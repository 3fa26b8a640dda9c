"""Memory heads (``BilinearConfig.memory_heads``): the projective gated delta rule's chunked form against its loop
(fp64: outputs, memory, every gradient), the loop against the textbook gated delta rule, the memory's own
normalization, the decoding step's kernel, and the model with memory heads (scale invariance, fp32 against fp64, its
initial bag). Resets, decoding, padding and every implementation's gradients: test_layouts.py, with the other
layouts; generation: test_generation.py and test_compiled_decoding.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling import delta_rule_chunk, dispatch, modeling_bilinear
from bilinear_lm.modeling.delta_rule_chunk import chunk_delta_rule
from bilinear_lm.modeling.dispatch import memory_recurrence
from bilinear_lm.modeling.chunked_normalization import is_boundary
from bilinear_lm.modeling.delta_rule_reference import delta_rule_step, reference_delta_rule
from bilinear_lm.modeling.transformers_compat import returned_cache

MEMORY = {"memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3}


def inputs(B=2, T=100, N=3, Dk=5, Dv=4, seed=0, dtype=torch.float64):
    """Random ``(q, k, v, g, beta, S, c)`` in the ranges the module produces (unit q and k, ``g <= 0``, ``beta`` in
    (0, 2)), all requiring gradients."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = F.normalize(randn(B, T, N, Dk), dim=-1), F.normalize(randn(B, T, N, Dk), dim=-1)
    g = -torch.rand(B, T, N, generator=gen, dtype=dtype) * 0.3
    beta = 2 * torch.rand(B, T, N, generator=gen, dtype=dtype)
    c = torch.rand(B, N, generator=gen, dtype=dtype) + 0.5
    return [x.requires_grad_() for x in (q, k, randn(B, T, N, Dv), g, beta, randn(B, N, Dv, Dk), c)]


def run(fn, xs, *args):
    """``fn``'s outputs and memory, and the gradients of a random functional of all three w.r.t. every input."""
    o, (S, c) = fn(*xs[:5], (xs[5], xs[6]), *args)
    gen = torch.Generator().manual_seed(1)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=x.dtype)).sum() for x in (o, S, c))
    return [o, S, c, *torch.autograd.grad(loss, xs)]


@pytest.mark.parametrize("block", [64, 7])
@pytest.mark.parametrize("chunk,offset,masked,reset", [(0, 0, False, False), (16, 5, True, True), (64, 3, False, True),
                                                        (10, 0, True, False)])
def test_chunked_form_equals_the_loop_fp64(block, chunk, offset, masked, reset, monkeypatch):
    """Outputs, final ``S`` and ``c`` and the gradients of every input (initial memory included) agree to rounding,
    with blocks shorter than and crossing the normalization chunks, padding, resets and an offset."""
    monkeypatch.setattr(delta_rule_chunk, "BLOCK", block)
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 100, generator=gen) > 0.2 if masked else None
    resets = torch.rand(2, 100, generator=gen) > 0.9 if reset else None
    xs = inputs()
    expected = run(reference_delta_rule, xs, mask, chunk, offset, resets)
    for got, want in zip(run(chunk_delta_rule, xs, mask, chunk, offset, resets), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_eager_decoding_step_runs_the_kernel_equal_to_the_loop_step(dtype, tol, monkeypatch):
    """One position without gradients, eager, runs the C++ ``delta_rule_step``: equal to the loop's
    ``delta_rule_step`` with a padded row, a restarting row, a padded restarting row, and a chunk boundary (also
    given by a 0-d tensor offset, a static cache's count), at key and value sizes of no SIMD width. A compiled step
    runs the PyTorch step instead (Inductor fuses it), and so does a step with gradients."""
    if dispatch.load_cpu_kernels is None or dispatch.load_cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    q, k, v, g, beta, S, c = (x.detach().to(dtype) for x in inputs(B=4, T=1, N=3, Dk=19, Dv=7))
    mask, reset = torch.tensor([[1], [0], [1], [0]]), torch.tensor([[0], [0], [1], [1]], dtype=torch.bool)
    calls = []
    kernel = dispatch.load_cpu_kernels()
    monkeypatch.setattr(dispatch, "load_cpu_kernels", lambda: type("Spy", (), {
        "delta_rule_step": lambda self, *args: calls.append(1) or kernel.delta_rule_step(*args)})())
    for chunk, offset in [(0, 0), (4, 3), (4, torch.tensor(3)), (4, 1)]:
        with torch.no_grad():
            o, (S1, c1) = memory_recurrence(q, k, v, g, beta, (S, c), mask, chunk, offset, "auto", reset)
        (S2, c2), o2 = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], (S, c), mask[:, 0],
                                       is_boundary(chunk, offset, 0), reset[:, 0])
        for got, want in ((o[:, 0], o2), (S1, S2), (c1, c2)):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert len(calls) == 4
    memory_recurrence(q, k, v, g, beta, (S, c), mask, 4, 3, "auto", reset)  # gradients on: the PyTorch step
    with torch.no_grad():
        torch.compile(memory_recurrence, backend="eager", fullgraph=True)(q, k, v, g, beta, (S, c), mask, 4,
                                                                           torch.tensor(3), "auto", reset)
    assert len(calls) == 4


def test_the_loop_is_the_gated_delta_rule_with_negative_eigenvalues():
    """``S / c`` follows ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = S_t q_t``,
    written with explicit matrices (independent code), whatever the normalization and ``c``'s starting value."""
    q, k, v, g, beta, S0, c0 = (x.detach() for x in inputs(T=40))
    S = S0 / c0[..., None, None]
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    outputs = []
    for t in range(q.shape[1]):
        kk = k[:, t, :, :, None] * k[:, t, :, None, :]
        S = g[:, t].exp()[..., None, None] * S @ (eye - beta[:, t, ..., None, None] * kk) \
            + beta[:, t, ..., None, None] * v[:, t, :, :, None] * k[:, t, :, None, :]
        outputs.append(S @ q[:, t, ..., None])
    expected = torch.cat(outputs, dim=-1).permute(0, 3, 1, 2)
    for chunk in (0, 1, 8):
        o, (S_end, c_end) = reference_delta_rule(q, k, v, g, beta, (S0, c0), chunk=chunk)
        torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(S_end / c_end[..., None, None], S, rtol=1e-12, atol=1e-12)


def test_the_memory_normalizes_by_its_own_norm_at_chunk_boundaries():
    """At a boundary each (row, head) memory ``[S; c]`` has unit norm, whatever it was (here 1e20 larger)."""
    q, k, v, g, beta, S0, c0 = (x.detach() for x in inputs(T=16))
    for impl in ("reference", "torch"):
        _, (S, c) = memory_recurrence(q, k, v, g, beta, (S0 * 1e20, c0 * 1e20), chunk=8, impl=impl)
        norm = (S.pow(2).sum((-2, -1)) + c.pow(2)).sqrt()
        torch.testing.assert_close(norm, torch.ones_like(norm), rtol=1e-12, atol=0)


def build(changes=None, dtype=torch.float64, seed=0):
    """The tiny model with memory heads (and ``changes``), their convolution at random weights (zero at init: the
    identity would hide a wrong window)."""
    config = BilinearConfig(**{**dict(vocab_size=67, hidden_size=24, num_hidden_layers=2, num_heads=3, state_size=5,
                                      rank=7, intermediate_size=40, norm_chunk_size=4), **MEMORY, **(changes or {})})
    torch.manual_seed(seed)
    model = BilinearForCausalLM(config).to(dtype).eval()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.mixer.memory.conv.weight, std=0.5)
    return model


def test_memory_heads_are_scale_invariant():
    """Normalizing every step, every 7 steps or never gives the same logits, and rescaling a cached memory
    ``(S, c)`` by any positive factor changes no later logit."""
    ids = torch.randint(0, 67, (2, 40))
    with torch.no_grad():
        logits = [build({"norm_chunk_size": chunk})(ids).logits for chunk in (0, 1, 7)]
        for other in logits[1:]:
            torch.testing.assert_close(other, logits[0], rtol=1e-12, atol=1e-12)
        model = build()
        cache = returned_cache(model(ids[:, :10], use_cache=True))
        expected = model(ids[:, 10:], cache=copy.deepcopy(cache)).logits
        for layer in cache.layers:
            scale = torch.tensor([1e-20, 3e15], dtype=torch.float64)
            layer.recurrent_states[1] = layer.recurrent_states[1] * scale[:, None, None, None]
            layer.recurrent_states[2] = layer.recurrent_states[2] * scale[:, None]
        torch.testing.assert_close(model(ids[:, 10:], cache=cache).logits, expected, rtol=1e-12, atol=1e-12)


def test_long_fp32_forward_stays_close_to_fp64():
    """4,096 positions in fp32 (64 normalizations, long products of decays) stay within fp32 rounding of fp64."""
    model = build({"num_hidden_layers": 1, "norm_chunk_size": 64})
    ids = torch.randint(0, 67, (1, 4096))
    with torch.no_grad():
        expected = model(ids).logits
        got = copy.deepcopy(model).float()(ids).logits
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_at_init_the_memory_reads_a_positive_bag_written_weakly(monkeypatch):
    """An untrained model's memory heads meet every earlier key with a clearly positive ``q . k`` (the shared key
    offset: a query reads a decayed sum of the values before it, the same way for every query) and write with
    ``beta`` near ``2 sigmoid(-3)``; their read-out has no gate. Without the offset the mean ``q . k`` is 0.004 and
    MQAR at vocabulary 8,192 stays at chance (docs/results-history.md, "Issue 38: the memory heads recall")."""
    seen = []
    recurrence = modeling_bilinear.memory_recurrence
    monkeypatch.setattr(modeling_bilinear, "memory_recurrence", lambda *a, **k: seen.append(a[:5]) or recurrence(*a, **k))
    torch.manual_seed(0)
    config = BilinearConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_heads=4, state_size=16,
                            memory_heads=4, memory_key_size=16, memory_value_size=16)
    model = BilinearForCausalLM(config)
    with torch.no_grad():
        model(torch.randint(0, 512, (4, 64)))
    for (q, k, v, g, beta), layer in zip(seen, model.model.layers):
        qk = torch.einsum("btnd,bsnd->bnts", q, k).tril(-1)
        mean = qk.sum() / (qk != 0).sum()
        assert mean > 0.3, f"mean q . k at init {mean:.3f}"
        assert 0.05 < beta.min() and beta.max() < 0.2, f"beta at init in [{beta.min():.3f}, {beta.max():.3f}]"
        assert layer.mixer.memory.in_proj.out_features == 4 * (16 + 16 + 16) + 4 + 4  # q, k, v, beta, alpha: no gate


@pytest.mark.parametrize("field,value", [("memory_heads", -1), ("memory_heads", 1.5), ("memory_key_size", 0),
                                         ("memory_value_size", -4), ("memory_conv_width", 1)])
def test_config_rejects_bad_memory_fields_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        BilinearConfig(**{"memory_heads": 2, field: value})
