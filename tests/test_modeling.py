"""Model-level behaviour: scale invariance, padding, long sequences, config validation, HF features."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from bilinear_lm import BilinearConfig, BilinearForCausalLM, BilinearModel


def build(config, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return BilinearForCausalLM(config).to(dtype).eval()


def with_changes(config, **changes):
    return BilinearConfig(**{**config.to_dict(), **changes})


def test_auto_classes_are_registered(tiny_bilinear_config):
    assert isinstance(AutoConfig.for_model("bilinear", vocab_size=5), BilinearConfig)
    assert isinstance(AutoModel.from_config(tiny_bilinear_config), BilinearModel)
    model = AutoModelForCausalLM.from_config(tiny_bilinear_config)
    assert isinstance(model, BilinearForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default


@pytest.mark.parametrize("write_channel,coupled_write", [(False, False), (True, False), (True, True)])
def test_chunked_normalization_does_not_change_logits(tiny_bilinear_config, write_channel, coupled_write):
    """Exact scale invariance, also with the write channel: ``[h; c]`` is normalized together."""
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 40))
    logits = {}
    for chunk in (0, 1, 7):
        model = build(with_changes(tiny_bilinear_config, norm_chunk_size=chunk, write_channel=write_channel,
                                   coupled_write=coupled_write),
                      torch.float64)
        with torch.no_grad():
            logits[chunk] = model(ids).logits
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits[7], logits[0], rtol=1e-12, atol=1e-12)


def test_state_rescaling_is_invisible(tiny_bilinear_config):
    """Scale invariance itself: any positive rescaling of a cached state leaves every later logit unchanged."""
    model = build(tiny_bilinear_config, torch.float64)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 20))
    with torch.no_grad():
        out = model(ids[:, :10], use_cache=True)
        reference = model(ids[:, 10:], past_key_values=copy.deepcopy(out.past_key_values)).logits
        cache = out.past_key_values
        cache.states = [s * torch.tensor([1e-20, 3e15], dtype=s.dtype)[:, None, None] for s in cache.states]
        rescaled = model(ids[:, 10:], past_key_values=cache).logits
    torch.testing.assert_close(rescaled, reference, rtol=1e-12, atol=1e-12)


def test_additive_input_breaks_scale_invariance(tiny_bilinear_config):
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (1, 30))
    logits = []
    for chunk in (0, 5):
        model = build(with_changes(tiny_bilinear_config, additive_input=True, norm_chunk_size=chunk), torch.float64)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-6


@pytest.mark.parametrize("autocast", [False, True])
def test_100k_token_forward_stays_finite(tiny_bilinear_config, autocast):
    config = with_changes(tiny_bilinear_config, norm_chunk_size=64, input_factor_init_std=0.5, num_hidden_layers=1)
    model = build(config)
    for layer in model.model.layers:  # a transition that grows the state ~e^5 per step without normalization
        layer.mixer.factor_bias.data.fill_(50.0)
    ids = torch.randint(0, config.vocab_size, (1, 100_000))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, use_cache=True)
    assert torch.isfinite(out.logits.float()).all()
    assert all(torch.isfinite(s).all() and s.norm(dim=-1).max() < 1e30 for s in out.past_key_values.states)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_left_padding_gives_the_unpadded_logits(tiny_bilinear_config, dtype, tol):
    model = build(tiny_bilinear_config, dtype)
    long_row = torch.randint(1, tiny_bilinear_config.vocab_size, (1, 20))
    short_row = torch.randint(1, tiny_bilinear_config.vocab_size, (1, 13))
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, 7, dtype=torch.long), short_row], 1)])
    mask = torch.ones_like(batch)
    mask[1, :7] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = model(short_row).logits
        alone_long = model(long_row).logits
    torch.testing.assert_close(padded[1, 7:], alone[0], rtol=tol, atol=tol)
    torch.testing.assert_close(padded[0], alone_long[0], rtol=tol, atol=tol)


def test_every_recurrence_impl_gives_the_reference_model_gradients(tiny_bilinear_config):
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 33))
    grads = []
    for impl in ("reference", "torch", "cpp"):
        model = build(with_changes(tiny_bilinear_config, recurrence_impl=impl), torch.float64).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


def test_gradient_checkpointing_gives_same_gradients(tiny_bilinear_config):
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 17))
    grads = []
    for checkpointing in (False, True):
        model = build(tiny_bilinear_config, torch.float64).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_output_hidden_states(tiny_bilinear_config):
    model = build(tiny_bilinear_config)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        base = model.model(ids)
    assert len(out.hidden_states) == tiny_bilinear_config.num_hidden_layers + 1
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))
    torch.testing.assert_close(out.hidden_states[-1], base.last_hidden_state)
    torch.testing.assert_close(out.logits, base.last_hidden_state @ model.lm_head.weight.T)


def test_save_load_safetensors_and_bf16(tiny_bilinear_config, tmp_path):
    model = build(tiny_bilinear_config)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin"))
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 12))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = bf16(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), model(ids).logits, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("field,value", [
    ("rank", 0), ("num_heads", -2), ("state_size", 2.5), ("norm_chunk_size", -1), ("hidden_act", "tanh"),
    ("mixer_type", "lstm"), ("recurrence_impl", "cuda"), ("rms_norm_eps", 0.0), ("conv_width", 1), ("conv_width", -3),
    ("gate_activation", "tanh"), ("rotation_init_base", -1.0), ("factor_bias_min", 0.0), ("factor_bias_min", 1.5),
    ("input_factor_multiplier", 0.0), ("input_factor_multiplier", -1.0),
])
def test_config_rejects_nonsense_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BilinearConfig(**{field: value})


def test_config_rejects_incompatible_block_sizes():
    with pytest.raises(ValueError, match="write_channel needs mixer_type='cp'"):
        BilinearConfig(mixer_type="full", write_channel=True)
    with pytest.raises(ValueError, match="coupled_write needs write_channel=True"):
        BilinearConfig(coupled_write=True)
    with pytest.raises(ValueError, match="block_size"):
        BilinearConfig(mixer_type="block_diagonal", state_size=10, block_size=3)
    with pytest.raises(ValueError, match="even"):
        BilinearConfig(mixer_type="rotation", state_size=7)
    with pytest.raises(ValueError, match="rotation_init_base .* needs mixer_type='cp'"):
        BilinearConfig(mixer_type="full", rotation_init_base=100.0)
    with pytest.raises(ValueError, match="factor_bias_min .* needs mixer_type='cp'"):
        BilinearConfig(mixer_type="diagonal", factor_bias_min=0.9)


def test_factor_bias_min_spreads_the_input_factor_offsets():
    """``factor_bias_min``: each head's input-factor offsets start evenly spaced over ``[min, 1]`` (all 1 without
    it), so at zero input ``A(x) = W1 diag(offsets) W2^T`` has exactly those eigenvalues."""
    config = BilinearConfig(vocab_size=11, hidden_size=16, num_heads=2, state_size=5, rank=5, factor_bias_min=0.9)
    mixer = build(config).model.layers[0].mixer
    offsets = torch.tensor([0.9, 0.925, 0.95, 0.975, 1.0])
    torch.testing.assert_close(mixer.factor_bias.detach(), offsets.repeat(2))
    A = mixer.W1[1].detach().double() @ torch.diag(offsets.double()) @ mixer.W2[1].detach().double().T
    torch.testing.assert_close(torch.linalg.eigvalsh(A), offsets.double(), rtol=1e-6, atol=1e-6)
    plain = build(with_changes(config, factor_bias_min=1.0)).model.layers[0].mixer
    assert torch.equal(plain.factor_bias, torch.ones(10))


def test_input_factor_multiplier_is_the_same_model_at_init_with_its_factor_gradient_scaled():
    """``input_factor_multiplier`` m: ``u = bias + m (W_u x)`` with ``W_u`` drawn at ``std / m``, so at initialization
    the model is the one without it, and (chain rule) the gradient of the factor rows of ``in_proj`` is m times
    theirs while every other gradient is unchanged: under Adam, m is the factors' relative learning rate."""
    config = BilinearConfig(vocab_size=11, hidden_size=16, num_heads=2, state_size=5, rank=6, num_hidden_layers=2,
                            input_factor_init_std=0.3)
    ids = torch.randint(0, 11, (2, 9))
    runs = {}
    for m in (1.0, 0.25):
        model = build(with_changes(config, input_factor_multiplier=m)).double()
        out = model(ids, labels=ids)
        out.loss.backward()
        runs[m] = out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}
    (logits, grads), (scaled_logits, scaled_grads) = runs[1.0], runs[0.25]
    torch.testing.assert_close(scaled_logits, logits, rtol=1e-5, atol=1e-6)
    factor_rows = config.num_heads * config.rank
    for name, grad in grads.items():
        expected = grad.clone()
        if name.endswith("mixer.in_proj.weight"):
            expected[:factor_rows] *= 0.25
        torch.testing.assert_close(scaled_grads[name], expected, rtol=1e-4, atol=1e-8, msg=name)


@pytest.mark.parametrize("state_size,rank", [(8, 8), (10, 6), (6, 9)])
def test_rotation_init_starts_at_rope_rotations(state_size, rank):
    """``rotation_init_base``: the rank-space transition ``W2^T W1`` starts as rotations by ``base^(-2k/rank)``
    (eigenvalues ``exp(+-i angle)``, one 1 for an odd rank), and ``A(x) = W1 W2^T`` at unit gains is orthogonal when
    ``state_size == rank``; without it ``W1 == W2``."""
    config = BilinearConfig(vocab_size=11, hidden_size=16, num_heads=2, state_size=state_size, rank=rank,
                            rotation_init_base=100.0)
    mixer = build(config).model.layers[0].mixer
    W1, W2 = mixer.W1.detach().double(), mixer.W2.detach().double()
    angles = 100.0 ** (-2 * torch.arange(rank // 2, dtype=torch.float64) / rank)
    expected = torch.cat([angles, angles, torch.zeros(rank % 2, dtype=torch.float64)]).sort().values
    if state_size >= rank:  # W2 has orthonormal columns, so W2^T W1 is exactly the rotation
        for n in range(2):
            got = torch.linalg.eigvals(W2[n].T @ W1[n])
            torch.testing.assert_close(got.abs(), torch.ones(rank, dtype=torch.float64), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.angle().abs().sort().values, expected, rtol=1e-5, atol=1e-5)
    if state_size == rank:
        A = W1[0] @ W2[0].T
        torch.testing.assert_close(A.T @ A, torch.eye(rank, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    plain = build(with_changes(config, rotation_init_base=0.0)).model.layers[0].mixer
    assert torch.equal(plain.W1, plain.W2)


def test_paper_minimal_model_is_a_config():
    config = BilinearConfig(vocab_size=7, hidden_size=8, num_hidden_layers=1, use_mlp=False, mixer_type="full",
                            num_heads=1, state_size=8, rank=8)
    model = BilinearForCausalLM(config)
    assert [name for name, _ in model.model.layers[0].named_children()] == ["mixer_norm", "mixer"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_linear_kernel_equals_matmul(dtype, monkeypatch):
    from bilinear_lm.modeling import cpu_kernels

    kernel = cpu_kernels.load_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler: Linear is plain F.linear here")
    calls = []

    class Spy:  # records which calls reach the compiled GEMV
        def small_batch_linear(self, x, w):
            calls.append(x.shape[0])
            return kernel.small_batch_linear(x, w)

    monkeypatch.setattr(cpu_kernels, "built_kernel", lambda: Spy())
    torch.manual_seed(0)
    layer = cpu_kernels.Linear(37, 23).to(dtype)  # out features not a multiple of the kernel's 4-row blocks
    for shape in [(1, 1, 37), (3, 37), (2, 2, 37), (5, 37)]:  # 1-4 rows take the kernel, 5 the matmul
        x = torch.randn(shape, dtype=dtype)
        with torch.no_grad():
            y = layer(x)
        expected = (x.double() @ layer.weight.double().t()).to(dtype)
        assert y.shape == (*shape[:-1], 23)
        torch.testing.assert_close(y, expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6)
    assert calls == [1, 3, 4]
    x = torch.randn(1, 37, dtype=dtype, requires_grad=True)
    layer(x).sum().backward()  # with gradients enabled the layer is F.linear, so autograd works
    torch.testing.assert_close(x.grad, layer.weight.sum(0, keepdim=True))
    assert calls == [1, 3, 4]


from bilinear_lm.modeling.ops import fused_decode_weights


def _decode_block(config, dtype=torch.float64):
    from bilinear_lm.modeling.cpu_kernels import load_kernel
    from bilinear_lm.modeling.modeling_bilinear import BilinearBlock

    if load_kernel() is None:
        pytest.skip("no C++ compiler: decoding runs the modules")
    torch.manual_seed(0)
    block = BilinearBlock(config, 0).to(dtype)
    block.mixer.reset_parameters()
    return block


def _fused_and_modules(block, *args):
    *expected, no_conv_state = block(*args)  # gradients enabled: the modules
    with torch.no_grad():
        assert fused_decode_weights(block, args[0]) is not None
        *fused, fused_conv_state = block(*args)
    assert no_conv_state is None and fused_conv_state is None
    return fused, [t.detach() for t in expected]


@pytest.mark.parametrize("use_gate,use_mlp", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("offset", [5, 6])  # position 7 is a normalization boundary with norm_chunk_size 7
@pytest.mark.parametrize("multiplier", [1.0, 0.3])  # input_factor_multiplier
def test_fused_decode_step_equals_block_modules(tiny_bilinear_config, use_gate, use_mlp, offset, multiplier):
    config = with_changes(tiny_bilinear_config, use_gate=use_gate, use_mlp=use_mlp, norm_chunk_size=7,
                          input_factor_multiplier=multiplier)
    block = _decode_block(config)
    B, N, H = 4, config.num_heads, config.state_size
    x = torch.randn(B, 1, config.hidden_size, dtype=torch.float64)
    state = torch.randn(B, N, H, dtype=torch.float64)
    state[1, 0] *= 1e30  # leaves the safe range after the step: the overflow guard renormalizes this head
    mask = torch.tensor([[1], [1], [0], [1]])  # row 2 is padding: its state must stay unchanged
    fused, expected = _fused_and_modules(block, x, state, mask, offset)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused[-1][2], state[2], rtol=0, atol=0)
    assert fused[-1][1, 0].abs().max() < 2.0  # renormalized by the guard


def test_fused_decode_step_equals_block_modules_at_a_rank_that_takes_every_register_block(tiny_bilinear_config):
    """W2^T h runs through the kernels' shared vector-matrix product: rank 115 = 64 + 32 + 16 + 3 takes each of its
    column blocks, at a normalization boundary."""
    config = with_changes(tiny_bilinear_config, state_size=20, rank=115, norm_chunk_size=7)
    block = _decode_block(config)
    x = torch.randn(3, 1, config.hidden_size, dtype=torch.float64)
    state = torch.randn(3, config.num_heads, config.state_size, dtype=torch.float64)
    fused, expected = _fused_and_modules(block, x, state, None, 6)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fused_decode_step_from_initial_state_in_fp32(tiny_bilinear_config):
    block = _decode_block(tiny_bilinear_config, torch.float32)
    x = torch.randn(2, 1, tiny_bilinear_config.hidden_size)
    fused, expected = _fused_and_modules(block, x, None, None, 0)  # state None: the learned h0
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_decode_step_is_not_taken_outside_its_cover(tiny_bilinear_config):
    block = _decode_block(tiny_bilinear_config, torch.float32)
    D = tiny_bilinear_config.hidden_size
    with torch.no_grad():
        assert fused_decode_weights(block, torch.randn(4, 1, D)) is not None
        assert fused_decode_weights(block, torch.randn(5, 1, D)) is None  # too many rows
        assert fused_decode_weights(block, torch.randn(1, 2, D)) is None  # two positions
        assert fused_decode_weights(block.to(torch.bfloat16), torch.randn(1, 1, D, dtype=torch.bfloat16)) is None
        block.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fused_decode_weights(block, torch.randn(1, 1, D)) is None
        block.mixer.state_norm.double()
        assert fused_decode_weights(block, torch.randn(1, 1, D)) is None  # a weight in another dtype
        block.mixer.state_norm.float()
        assert fused_decode_weights(block, torch.randn(1, 1, D)) is not None
        block.mixer.in_proj = torch.nn.Linear(D, block.mixer.in_proj.out_features, bias=False)  # e.g. an adapter
        assert fused_decode_weights(block, torch.randn(1, 1, D)) is None


def test_mixer_states_are_the_recurrence_states(tiny_bilinear_config):
    """``output_mixer_states``: layer l's states equal the reference loop run on that layer's own input factors."""
    from functools import partial

    from bilinear_lm.modeling.recurrence import cp_transition, reference_recurrence

    model = build(tiny_bilinear_config, torch.float64)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_mixer_states=True)
        assert len(out.mixer_states) == tiny_bilinear_config.num_hidden_layers
        for layer, x, states in zip(model.model.layers, out.hidden_states, out.mixer_states):
            mixer = layer.mixer
            factors = mixer.in_proj(layer.mixer_norm(x))[..., :mixer.split_sizes[0]] + mixer.factor_bias
            expected, _ = reference_recurrence(partial(cp_transition, W1=mixer.W1, W2=mixer.W2),
                                               factors.view(2, 9, mixer.num_heads, -1), mixer.h0,
                                               chunk=tiny_bilinear_config.norm_chunk_size)
            torch.testing.assert_close(states, expected, rtol=1e-10, atol=1e-12)
    assert model(ids).mixer_states is None


def test_torch_compile_traces_a_training_step_of_the_tiny_preset_in_one_graph():
    """The scans are custom ops with fake implementations: the whole forward and backward trace as one graph
    (``fullgraph=True`` fails on any graph break), and the compiled step's loss and gradients equal eager mode."""
    import yaml

    from conftest import REPO_ROOT

    model_keys = yaml.safe_load((REPO_ROOT / "bilinear_lm/configs/tiny.yaml").read_text())["model"]
    torch.manual_seed(0)
    model = BilinearForCausalLM(BilinearConfig(vocab_size=512, **model_keys)).train()
    ids = torch.randint(0, 512, (2, 80))  # past one normalization boundary (norm_chunk_size 64)
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_bad_input_ids_raise_a_clear_error(tiny_bilinear_config):
    model = build(tiny_bilinear_config)
    V = tiny_bilinear_config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {V} is outside the model's vocabulary \[0, {V}\)"):
        model(torch.tensor([[1, V, 2]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token id {V + 5} is outside"):
        model.generate(torch.tensor([[1, V + 5]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one position"):
        model(inputs_embeds=torch.zeros(1, 0, tiny_bilinear_config.hidden_size))


def test_short_conv_equals_an_explicit_causal_loop_and_starts_as_the_identity(tiny_bilinear_config):
    from bilinear_lm.modeling.modeling_bilinear import BilinearShortConv

    conv = BilinearShortConv(6, 4).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y, window = conv(x)
    torch.testing.assert_close(y, x)  # zero weight at init: x + conv(x) = x
    torch.testing.assert_close(window, x[:, -3:])
    torch.nn.init.normal_(conv.weight)
    w = conv.weight[:, 0]  # [D, width]; tap k multiplies x_{t - (width - 1) + k}
    history = torch.randn(2, 3, 6, dtype=torch.float64)
    y, window = conv(x, history)
    padded = torch.cat([history, x], dim=1)
    expected = torch.stack([x[:, t] + sum(w[:, k] * padded[:, t + k] for k in range(4)) for t in range(9)], dim=1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(window, x[:, -3:])


def test_zero_initialized_conv_leaves_the_model_unchanged(tiny_bilinear_config):
    plain = build(tiny_bilinear_config, torch.float64)
    with_conv = BilinearForCausalLM(with_changes(tiny_bilinear_config, conv_width=4)).double().eval()
    missing, unexpected = with_conv.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and sorted(missing) == [f"model.layers.{i}.conv.weight" for i in range(2)]
    assert all(layer.conv.weight.abs().max() == 0 for layer in with_conv.model.layers)
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(with_conv(ids).logits, plain(ids).logits, rtol=0, atol=0)
        assert fused_decode_weights(with_conv.model.layers[0], torch.randn(1, 1, 24, dtype=torch.float64)) is None


def test_residual_conv_mixes_the_stream_the_mlp_sees(tiny_bilinear_config):
    """``conv_residual``: the block is ``h' = h + conv(h)``, then ``h' + mixer(norm(h'))``, then the MLP residual,
    checked against that composition written out with an explicit causal convolution."""
    model = build(with_changes(tiny_bilinear_config, conv_width=3, conv_residual=True), torch.float64)
    layer = model.model.layers[0]
    torch.nn.init.normal_(layer.conv.weight, std=0.5)
    h = torch.randn(2, 7, tiny_bilinear_config.hidden_size, dtype=torch.float64)
    w = layer.conv.weight[:, 0].detach()
    padded = torch.cat([h.new_zeros(2, 2, h.shape[-1]), h], dim=1)
    mixed_stream = h + torch.stack([sum(w[:, k] * padded[:, t + k] for k in range(3)) for t in range(7)], dim=1)
    with torch.no_grad():
        after_mixer = mixed_stream + layer.mixer(layer.mixer_norm(mixed_stream))[0]
        expected = after_mixer + layer.mlp(layer.mlp_norm(after_mixer))
        got, _, _, window = layer(h)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(window, h[:, -2:])
    with pytest.raises(ValueError, match="conv_residual needs conv_width"):
        BilinearConfig(conv_residual=True)


EOS = 3


def _packed_documents(vocab_size, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(4, vocab_size, (n,), generator=g) for n in lengths]
    return docs, torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs])


@pytest.mark.parametrize("impl", ["reference", "torch", "cpp"])
@pytest.mark.parametrize("changes", [{}, {"conv_width": 3}, {"conv_width": 3, "conv_residual": True},
                                     {"write_channel": True}, {"write_channel": True, "coupled_write": True}],
                         ids=["pure", "conv", "conv-residual", "write", "coupled-write"])
def test_reset_at_eos_equals_running_each_document_alone(tiny_bilinear_config, impl, changes):
    config = with_changes(tiny_bilinear_config, reset_state_at_eos=True, eos_token_id=EOS, recurrence_impl=impl,
                          **changes)
    model = build(config, torch.float64)
    for layer in model.model.layers:
        if layer.conv is not None:
            torch.nn.init.normal_(layer.conv.weight, std=0.5)  # zero at init would hide a window crossing documents
    docs, packed = _packed_documents(config.vocab_size, [7, 1, 12, 5])
    with torch.no_grad():
        logits = model(packed[None]).logits[0]
        start = 0
        for doc in docs:
            alone = model(torch.cat([doc, torch.tensor([EOS])])[None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(doc) + 1], alone, rtol=1e-9, atol=1e-9)
            start += len(doc) + 1
        plain = build(with_changes(config, reset_state_at_eos=False), torch.float64)(packed[None]).logits[0]
    assert (plain[9:] - logits[9:]).abs().max() > 1e-3  # without the reset the second document sees the first


@pytest.mark.parametrize("changes", [{}, {"conv_width": 3}, {"conv_width": 3, "conv_residual": True}],
                         ids=["pure", "conv", "conv-residual"])
def test_reset_at_eos_carries_across_cached_calls(tiny_bilinear_config, changes):
    """Prefill ending on EOS, then one token per call (the fused decoding step where it applies): the cache carries
    whether the last token was EOS, and the logits equal one full forward."""
    config = with_changes(tiny_bilinear_config, reset_state_at_eos=True, eos_token_id=EOS, **changes)
    model = build(config, torch.float64)
    for layer in model.model.layers:
        if layer.conv is not None:
            torch.nn.init.normal_(layer.conv.weight, std=0.5)
    _, packed = _packed_documents(config.vocab_size, [6, 3, 8], seed=1)
    ids = torch.stack([packed, packed.roll(4)])  # the second row's EOS positions differ
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)  # ends on row 0's first EOS
        pieces, cache = [out.logits], out.past_key_values
        assert cache.follows_eos.tolist() == [True, bool(ids[1, 6] == EOS)]
        for t in range(7, ids.shape[1]):
            pieces.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


def test_reset_needs_an_eos_token():
    with pytest.raises(ValueError, match="reset_state_at_eos needs eos_token_id"):
        BilinearConfig(reset_state_at_eos=True)
