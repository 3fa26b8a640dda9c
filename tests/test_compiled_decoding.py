"""``generate(..., cache_implementation="static")``: a ``BilinearStaticCache`` and one compiled program per decoding
step (Inductor, on CPU), against the eager path (``BilinearCache``, the same generate call without the option) and full
forwards. One model per layout (pure; hybrid with a full and a sliding attention layer), shared by the module's tests
with the same batch of 3 rows and cache length, so that each compiles once (compilation dominates the time)."""

import contextlib
import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, pipeline

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling import BilinearStaticCache
from bilinear_lm.modeling.modeling_bilinear import BilinearShortConv
from bilinear_lm.modeling.transformers_compat import returned_cache
from fixtures import cached_tokenizer

STEPS = 8
# The hybrid's fp64 model has no rotary embedding: Llama's rotary tables are fp32, and Inductor's cos and sin differ
# from ATen's by an ulp (logits within 1e-7 relative); the fp32 test runs it with them.
# The hybrid's bilinear layer has memory heads too.
LAYOUTS = {"pure": {},
           "hybrid": {"num_hidden_layers": 3, "num_key_value_heads": 1, "sliding_window": 3, "use_rope": False,
                      "layer_types": ["bilinear", "full_attention", "sliding_attention"],
                      "memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3}}


def graphs() -> int:
    """Graphs Dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    """A fp64 model with every kind of cached state (convolutions with random weights, resets at EOS, in the hybrid
    memory heads and attention layers with a static KV cache and a sliding window of 3), on the test tokenizer's vocabulary. It never
    stops at EOS (its generation config has none), so every row runs ``STEPS`` compiled steps."""
    tokenizer = cached_tokenizer()
    eos = tokenizer.eos_token_id
    config = BilinearConfig(**{**dict(vocab_size=len(tokenizer), hidden_size=24, num_hidden_layers=2, num_heads=3,
                                      state_size=5, rank=7, intermediate_size=40, norm_chunk_size=4, conv_width=3,
                                      reset_state_at_eos=True, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                      num_attention_heads=2), **LAYOUTS[request.param]})
    torch.manual_seed(0)
    model = BilinearForCausalLM(config).double().eval()
    for module in model.modules():  # zero at init: the identity would hide a wrong window
        if isinstance(module, BilinearShortConv):
            torch.nn.init.normal_(module.weight, std=0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.max_cache_len = 64  # one cache shape for every test: the hybrid's KV buffers
    return model


def prompts(vocab_size, seed=0, width=9, lengths=(9, 5, 7)):
    """3 left-padded rows (EOS-free: the tokenizer's EOS is its pad) and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (len(lengths), width), generator=g)
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@contextlib.contextmanager
def compiled_logits(model):
    """The fp64 logits of each compiled step (``generate`` keeps fp32 copies), recorded around the compiled call that
    ``generate`` reuses (``get_compiled_call`` caches it on the model)."""
    recorded, compiled = [], model._compiled_call

    def record(**kwargs):
        out = compiled(**kwargs)
        recorded.append(out.logits[:, -1].clone())
        return out

    model._compiled_call = record
    try:
        yield recorded
    finally:
        model._compiled_call = compiled


def assert_full_forward_logits(model, sequences, mask, logits):
    """``logits`` (one ``[B, V]`` per decoding step) are the full forward's over ``sequences``, in fp64 up to 1e-10."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], 1)
    with torch.no_grad():
        full = model(sequences, attention_mask=full_mask).logits
    start = mask.shape[1]  # the first compiled step reads the first new token
    torch.testing.assert_close(torch.stack(logits, 1), full[:, start:start + len(logits)], rtol=1e-10, atol=1e-10)


def both(model, *args, **kwargs):
    """``generate`` eager, then compiled (``cache_implementation="static"``)."""
    return model.generate(*args, **kwargs), model.generate(*args, cache_implementation="static", **kwargs)


def test_static_generate_runs_one_compiled_step_equal_to_eager_and_to_full_forwards(model):
    ids, mask = prompts(model.config.vocab_size)
    kwargs = dict(attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    before = graphs()
    eager = model.generate(ids, **kwargs)
    assert graphs() == before  # the default generate() stays eager
    compiled = model.generate(ids, cache_implementation="static", **kwargs)
    assert isinstance(returned_cache(compiled), BilinearStaticCache) and graphs() == before + 1
    assert torch.equal(compiled.sequences, eager.sequences)
    for got, expected in zip(compiled.logits, eager.logits):  # generate keeps fp32 copies
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    full_mask = torch.cat([mask, torch.ones(3, STEPS, dtype=torch.long)], 1)
    with torch.no_grad():  # each new token is the argmax of a full forward over the sequence before it
        full = model(compiled.sequences, attention_mask=full_mask).logits
    assert torch.equal(full[:, ids.shape[1] - 1:-1].argmax(-1), compiled.sequences[:, ids.shape[1]:])
    with compiled_logits(model) as logits:  # the compiled steps' fp64 logits are the full forward's
        model.generate(ids, cache_implementation="static", **kwargs)
    assert_full_forward_logits(model, compiled.sequences[:, :-1], mask, logits)
    uncompiled = model.generate(ids, cache_implementation="static", disable_compile=True, **kwargs)
    assert torch.equal(uncompiled.sequences, eager.sequences)  # the static cache in eager mode
    with pytest.raises(ValueError, match="prefill_chunk_size=None"):
        model.generate(ids, cache_implementation="static", prefill_chunk_size=4, **kwargs)
    # The step's program holds at every position and for the next call: no recompilation.
    with torch._dynamo.config.patch(error_on_recompile=True):
        other, other_mask = prompts(model.config.vocab_size, seed=1, width=12, lengths=(12, 1, 6))
        again = model.generate(other, attention_mask=other_mask, max_new_tokens=2 * STEPS, do_sample=False,
                               cache_implementation="static")
    assert torch.equal(again, model.generate(other, attention_mask=other_mask, max_new_tokens=2 * STEPS,
                                             do_sample=False))


def test_beam_search_and_seeded_sampling_equal_eager(model):
    ids, mask = prompts(model.config.vocab_size, seed=2, lengths=(9,))
    eager, compiled = both(model, ids, attention_mask=mask, max_new_tokens=STEPS, num_beams=3,
                           num_return_sequences=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.sequences_scores, eager.sequences_scores, rtol=1e-10, atol=1e-10)
    ids, mask = prompts(model.config.vocab_size, seed=3)
    sampled = []
    for implementation in (None, "static"):
        torch.manual_seed(0)
        sampled.append(model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=True, top_k=20,
                                      cache_implementation=implementation))
    assert torch.equal(*sampled)


class ForceEOS(LogitsProcessor):
    """Row ``row`` emits EOS at the given decoding steps."""

    def __init__(self, prompt_len, row, steps, eos):
        self.prompt_len, self.row, self.steps, self.eos = prompt_len, row, steps, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len in self.steps:
            scores = scores.clone()
            scores[self.row] = -float("inf")
            scores[self.row, self.eos] = 0.0
        return scores


def test_reset_at_eos_in_compiled_steps_equals_eager(model):
    """Documents in the prompt, a prompt ending on EOS (the first compiled step restarts) and EOS emitted while
    decoding: every layer restarts from ``h_start`` in the compiled step as in eager mode, in the hybrid the attention
    layers' mask stops at the document's start."""
    eos = model.config.eos_token_id
    ids, mask = prompts(model.config.vocab_size, seed=4)
    ids[0, 3], ids[1, -1], ids[2, 5] = eos, eos, eos  # the tokenizer's EOS is its pad: the mask says what is padding
    force = LogitsProcessorList([ForceEOS(ids.shape[1], 2, {1, 4}, eos)])
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, logits_processor=force)
    with compiled_logits(model) as logits:
        compiled = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                                  logits_processor=force, cache_implementation="static")
    assert torch.equal(compiled, eager)
    assert (compiled[2, ids.shape[1]:][[1, 4]] == eos).all()
    assert_full_forward_logits(model, compiled[:, :-1], mask, logits)  # the full forward restarts at each EOS


@pytest.mark.parametrize("model", ["hybrid"], indirect=True)  # its bilinear layer is the pure layout's
def test_text_generation_pipeline_with_a_static_cache_in_fp32(model):
    """The same option through ``pipeline`` (and a ``GenerationConfig``), fp32 and the hybrid with rotary embeddings:
    the same text as eager decoding, the logits within rounding."""
    tokenizer = copy.deepcopy(cached_tokenizer())
    tokenizer.padding_side = "left"
    config = copy.deepcopy(model.config)
    config.use_rope = True
    fp32 = BilinearForCausalLM(config).eval()
    fp32.load_state_dict(model.state_dict())
    fp32.generation_config = copy.deepcopy(model.generation_config)
    texts = ["The history of the", "A", "Good morrow, my"]
    run = pipeline("text-generation", model=fp32, tokenizer=tokenizer)
    eager = run(texts, max_new_tokens=STEPS, do_sample=False, batch_size=3)
    compiled = run(texts, batch_size=3, generation_config=GenerationConfig(
        max_new_tokens=STEPS, do_sample=False, cache_implementation="static", pad_token_id=tokenizer.pad_token_id))
    assert [r[0]["generated_text"] for r in compiled] == [r[0]["generated_text"] for r in eager]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager, compiled = both(fp32, **batch, **kwargs)
    assert torch.equal(compiled.sequences, eager.sequences)
    for got, expected in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_tensor_count_steps_as_the_python_count_and_compiles_once():
    """One decoding step of the recurrence with the position in a 0-d tensor (a static cache's count): the chunk
    boundary and the overflow guard select their factor with ``where``, bit for bit eager mode's ``if``, and compiled
    at every offset from one program (padding, a restart, one row far out of range)."""
    from bilinear_lm.modeling.dispatch import recurrence
    from bilinear_lm.modeling.bilinear_reference import CPTransition

    g = torch.Generator().manual_seed(0)
    B, N, H, R = 4, 2, 6, 5
    W1, W2, h_start = (torch.randn(*shape, generator=g, dtype=torch.float64)
                       for shape in ((N, H, R), (N, H, R), (N, H)))
    u = 1 + 0.1 * torch.randn(B, 1, N, R, generator=g, dtype=torch.float64)
    h = torch.randn(B, N, H, generator=g, dtype=torch.float64)
    h[3] *= 1e14  # its next state leaves the safe range: the guard normalizes it
    mask, reset = torch.tensor([[1], [0], [1], [1]]), torch.tensor([[0], [1], [1], [0]], dtype=torch.bool)

    def step(offset):
        return recurrence(CPTransition(W1, W2), u, h, mask, 4, offset, "reference", reset=reset, h_start=h_start)[1]

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(torch.tensor(0))  # compiles, once for every offset
        with torch._dynamo.config.patch(error_on_recompile=True):
            for offset in range(8):  # offsets 3 and 7 end a chunk
                want = step(offset)
                assert torch.equal(step(torch.tensor(offset)), want)
                got = compiled(torch.tensor(offset))
                scale = want.abs().amax(-1, keepdim=True)  # row 3 is 1e14 times larger
                torch.testing.assert_close(got / scale, want / scale, rtol=1e-13, atol=1e-13)
