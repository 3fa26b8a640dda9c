"""What every layout must do, one harness over the three (pure with a convolution, memory heads, hybrid with full and
sliding attention), in fp64 against an independent reference each: documents reset at EOS equal each document run
alone (every recurrence impl) and carry across cached calls; token-by-token decoding, prefill + decoding and a
left-padded row equal one full forward; every impl's gradients equal the reference loop's, with padding; a recording
cache goes back bit for bit and continues as the full forward, so assisted decoding (prompt lookup, an assistant
model) gives plain greedy decoding's tokens; packed rows equal each document alone.
(Generation over layouts: test_generation.py; compiled decoding: test_compiled_decoding.py.)"""

import pytest
import torch

from bilinear_lm import BilinearCache, BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling import dispatch
from bilinear_lm.modeling.cache_bilinear import BilinearCacheMixin, BilinearStaticCache, cache_layer_tensors
from bilinear_lm.modeling.modeling_bilinear import BilinearShortConv
from bilinear_lm.modeling.transformers_compat import CACHE_NAME, returned_cache
from conftest import TINY_CONFIG

EOS = 3
LAYOUTS = {
    "pure": {"conv_width": 3},
    "memory": {"conv_width": 3, "memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3},
    "hybrid": {"num_hidden_layers": 4, "conv_width": 3, "num_key_value_heads": 2, "sliding_window": 3,
               "layer_types": ["bilinear", "full_attention", "sliding_attention", "bilinear"]},
}
IMPLS = [impl for impl in ("reference", "torch", "cpp") if impl != "cpp" or dispatch.cpu_kernels_available()]


def build(layout: str, seed: int = 0, **changes) -> BilinearForCausalLM:
    """The tiny fp64 model in ``layout`` (plus ``changes``), its convolutions at random weights (zero at init: the
    identity would hide a window that crosses a document or a cache boundary)."""
    torch.manual_seed(seed)
    model = BilinearForCausalLM(BilinearConfig(**{**TINY_CONFIG, **LAYOUTS[layout], **changes})).double().eval()
    for module in model.modules():
        if isinstance(module, BilinearShortConv):
            torch.nn.init.normal_(module.weight, std=0.5)
    return model


def packed_documents(lengths, seed=0):
    """Documents of ``lengths`` random tokens, and all of them in one row, each followed by EOS."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(4, TINY_CONFIG["vocab_size"], (n,), generator=g) for n in lengths]
    return docs, torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reset_at_eos_equals_running_each_document_alone(layout, impl):
    """Every state restarts after EOS (tracking, memory, convolution windows; the attention layers look no further
    back); without the reset the second document sees the first."""
    model = build(layout, reset_state_at_eos=True, eos_token_id=EOS, recurrence_impl=impl)
    docs, packed = packed_documents([7, 1, 12, 5])
    with torch.no_grad():
        logits = model(packed[None]).logits[0]
        start = 0
        for doc in docs:
            alone = model(torch.cat([doc, torch.tensor([EOS])])[None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(doc) + 1], alone, rtol=1e-9, atol=1e-9)
            start += len(doc) + 1
        plain = build(layout, recurrence_impl=impl)(packed[None]).logits[0]
    assert (plain[9:] - logits[9:]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reset_at_eos_carries_across_cached_calls(layout):
    """A prefill ending on EOS, then one token per call: the cache carries whether the last token was EOS, and the
    logits equal one full forward (the second row's EOS positions differ)."""
    model = build(layout, reset_state_at_eos=True, eos_token_id=EOS)
    _, packed = packed_documents([6, 3, 8], seed=1)
    ids = torch.stack([packed, packed.roll(4)])
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)  # ends on row 0's first EOS
        pieces, cache = [out.logits], returned_cache(out)
        assert cache.follows_eos.tolist() == [True, bool(ids[1, 6] == EOS)]
        for t in range(7, ids.shape[1]):
            pieces.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decoding_and_left_padding_give_the_full_forward(layout):
    """Token-by-token decoding (the step paths) and prefill + decoding equal one full forward (the sequence paths),
    across normalization chunks and with documents reset at EOS; a left-padded row equals its row alone."""
    model = build(layout, reset_state_at_eos=True, eos_token_id=EOS)
    ids = torch.randint(4, TINY_CONFIG["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(2))
    ids[0, 10], ids[1, 20] = EOS, EOS
    with torch.no_grad():
        full = model(ids).logits
        cache = BilinearCache(model.config)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(30)], dim=1)
        cache = BilinearCache(model.config)
        split = torch.cat([model(ids[:, :13], cache=cache).logits, model(ids[:, 13:], cache=cache).logits], dim=1)
        padded = torch.cat([torch.zeros(1, 7, dtype=torch.long), ids[1:, :23]], dim=1)
        mask = torch.ones_like(padded)
        mask[:, :7] = 0
        padded_logits = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded_logits[0, 7:], full[1, :23], rtol=1e-10, atol=1e-10)


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds: each layer's (states, windows, keys), then the model's."""
    tensors = [t for layer in cache.layers for t in cache_layer_tensors(layer)]
    model_state = (*cache.attention_conv_windows.values(), cache.follows_eos, cache.document_start,
                   getattr(cache, "key_padding", None))
    return tensors + [t for t in model_state if t is not None]


CACHES = {"dynamic": lambda config: BilinearCache(config),
          "static": lambda config: BilinearStaticCache(config, max_cache_len=48)}


@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_crop_goes_back_bit_for_bit_and_continues_as_the_full_forward(layout, cache_kind):
    """A recording cache (dynamic, or static: buffers written in place) runs a draft of 6 tokens after a prefill (an
    EOS and a normalization boundary inside); ``crop`` back to each of its positions gives the states the draft's
    forward computed there, bit for bit (before the draft: every tensor of the cache, keys and the static cache's
    key buffers included), and the next forward's logits equal one full forward of what was kept and the
    continuation."""
    model = build(layout, reset_state_at_eos=True, eos_token_id=EOS)
    ids = torch.randint(4, TINY_CONFIG["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(4))
    ids[0, 11] = EOS
    prefill, draft, continuation = ids[:, :9], ids[:, 9:15], ids[:, 15:]
    with torch.no_grad():
        for kept in range(7):
            cache = CACHES[cache_kind](model.config)
            model(prefill, cache=cache)
            cache.activate_past_recording()
            before = [t.clone() for t in cache_tensors(cache)]
            drafted = model(draft, cache=cache, output_mixer_states=True)
            cache.crop(kept - 6)
            assert cache.get_seq_length() == 9 + kept
            if kept == 0:
                assert all(torch.equal(a, b) for a, b in zip(cache_tensors(cache), before, strict=True))
            else:
                bilinear = [i for i, kind in enumerate(model.config.layer_types) if kind == "bilinear"]
                for layer_idx, states in zip(bilinear, drafted.mixer_states, strict=True):
                    assert torch.equal(cache.layers[layer_idx].recurrent_states[0], states[:, kept - 1])
            logits = model(continuation, cache=cache).logits
            full = model(torch.cat([prefill, draft[:, :kept], continuation], 1)).logits[:, -continuation.shape[1]:]
            torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-10)


def count_crops(monkeypatch) -> list[int]:
    """The positions every crop of a bilinear cache removes, from now on."""
    removed, crop = [], BilinearCacheMixin.crop

    def counted(cache, tokens_to_remove):
        removed.append(-tokens_to_remove)
        return crop(cache, tokens_to_remove)

    monkeypatch.setattr(BilinearCacheMixin, "crop", counted)
    return removed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_assisted_decoding_gives_greedy_decodings_tokens(layout, monkeypatch):
    """Prompt lookup and an assistant model (another random model: most drafts rejected) give plain greedy
    decoding's tokens, after crops of every length, with the cache generate builds and with a static cache passed
    in; sampling with the assistant repeats under a seed. The models at a larger init, whose tokens vary (at the
    default they repeat one token)."""
    model = build(layout, initializer_range=0.5)
    assistant = build(layout, seed=1, initializer_range=0.5)
    prompt = torch.randint(4, TINY_CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([prompt, prompt[:, :6]], 1)  # a repeat: prompt lookup finds drafts
    greedy = model.generate(prompt, max_new_tokens=30, do_sample=False)
    assert len(set(greedy[0, 18:].tolist())) > 5
    removed = count_crops(monkeypatch)
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4), greedy)
    assert {0, 4} < set(removed)
    removed.clear()
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=assistant,
                                      num_assistant_tokens=4), greedy)
    assert max(removed) >= 2
    removed.clear()
    static = BilinearStaticCache(model.config, max_cache_len=48)
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4,
                                      **{CACHE_NAME: static}), greedy)
    assert {0, 4} < set(removed)
    sampled = []
    for _ in range(2):
        torch.manual_seed(5)
        sampled.append(model.generate(prompt, max_new_tokens=20, do_sample=True, assistant_model=assistant))
    assert torch.equal(*sampled) and sampled[0].shape[1] == 38


def test_a_crop_is_refused_with_one_line_where_it_cannot_go_back_and_changes_nothing():
    """Without recording (either cache), beyond ``max_rollback`` positions and with a positive count (transformers'
    convention is a negative one): each a one-line error, and the next forward's logits are as if no crop had been
    asked; a ``max_rollback`` that is not a count is refused in one line too."""
    model = build("hybrid")
    ids = torch.randint(4, TINY_CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids).logits[:, -1]
        recording = BilinearCache(model.config, max_rollback=2)
        model(ids[:, :4], cache=recording)
        recording.activate_past_recording()
        cases = [(BilinearCache(model.config), -1, "cannot go back to position 10, it keeps the states of no "
                  "positions: call cache.activate_past_recording"),
                 (recording, -3, "cannot go back to position 8, it keeps the states of positions 9..11.*max_rollback=2"),
                 (BilinearCache(model.config), 2, r"pass minus the number of positions to remove"),
                 (BilinearStaticCache(model.config, max_cache_len=16), -1, "cannot go back to position 10, it keeps")]
        for cache, count, message in cases:
            model(ids[:, :11] if cache is not recording else ids[:, 4:11], cache=cache)
            with pytest.raises(ValueError, match=message) as error:
                cache.crop(count)
            assert "\n" not in str(error.value)
            torch.testing.assert_close(model(ids[:, 11:], cache=cache).logits[:, -1], expected, rtol=1e-10,
                                       atol=1e-10)
    for make in (lambda n: BilinearCache(model.config, max_rollback=n),
                 lambda n: BilinearStaticCache(model.config, max_cache_len=16, max_rollback=n)):
        for bad in (-1, 2.5, None):
            with pytest.raises(ValueError, match=r"max_rollback=.*an int >= 0") as error:
                make(bad)
            assert "\n" not in str(error.value)


@pytest.mark.parametrize("cache_kind", list(CACHES))
def test_a_count_of_states_to_keep_extends_the_rollback(cache_kind):
    """transformers 5.25 passes ``activate_past_recording(recurrent_states_to_keep=n)``, the positions its caller may
    crop: a cache built to go back 2 then goes back 5, and continues as one full forward of what was kept (its
    ``get_recurrent_states_to_keep`` says so, and 0 before recording); a count that is not one is refused in one line.
    Called as transformers 5.23 and 5.24 call it (no count), the rollback stays ``max_rollback``."""
    model = build("hybrid")
    ids = torch.randint(4, TINY_CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7))
    make = {"dynamic": lambda: BilinearCache(model.config, max_rollback=2),
            "static": lambda: BilinearStaticCache(model.config, max_cache_len=24, max_rollback=2)}[cache_kind]
    with torch.no_grad():
        cache = make()
        model(ids[:, :6], cache=cache)
        assert cache.get_recurrent_states_to_keep() == 0
        cache.activate_past_recording(recurrent_states_to_keep=5)
        assert cache.get_recurrent_states_to_keep() == cache.get_recurrent_states_to_keep(1) == 5
        model(ids[:, 6:12], cache=cache)
        cache.crop(-5)
        logits = model(ids[:, 12:], cache=cache).logits
        full = model(torch.cat([ids[:, :7], ids[:, 12:]], 1)).logits[:, -4:]
        torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-10)
        plain = make()
        model(ids[:, :6], cache=plain)
        plain.activate_past_recording()
        model(ids[:, 6:12], cache=plain)
        with pytest.raises(ValueError, match="max_rollback=2"):
            plain.crop(-5)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"recurrent_states_to_keep=.*an int >= 0") as error:
            make().activate_past_recording(recurrent_states_to_keep=bad)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_recurrence_impl_gives_the_reference_loops_gradients(layout):
    """The scans and the chunked delta rule give the reference loops' loss and every parameter's gradient, with a
    left-padded row."""
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    grads = []
    for impl in IMPLS:
        model = build(layout, recurrence_impl=impl).train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


def packed_inputs(docs, form: str):
    """The documents as one padding-free row, as ``DataCollatorWithFlattening`` gives it: ``position_ids``
    restarting at 0, or the offsets ``cu_seq_lens_q``, or ``seq_idx``."""
    lengths = torch.tensor([len(d) for d in docs])
    if form == "position_ids":
        return {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    if form == "cu_seq_lens_q":
        return {"cu_seq_lens_q": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()}
    return {"seq_idx": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).int()[None]}


# Every layout by every impl; Triton (under TRITON_INTERPRET=1, 30 s a case) once: it runs the bilinear scan only,
# which is the same in every layout.
PACKED_CASES = [(layout, impl) for layout in LAYOUTS for impl in IMPLS] \
    + [("pure", "triton")] * dispatch._triton_available("cpu")


@pytest.mark.parametrize("layout, impl", PACKED_CASES)
def test_packed_rows_equal_each_document_alone_with_their_gradients(layout, impl):
    """Three documents of 9, 14 and 5 tokens in one row (position_ids restarting at 0) give each document's logits
    alone, and the gradient of any function of the packed logits is the sum of each document's (every state restarts:
    tracking, memory, convolution windows, the attention layers' keys)."""
    model = build(layout, recurrence_impl=impl).train()
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(4, TINY_CONFIG["vocab_size"], (n,), generator=g) for n in (9, 14, 5)]
    weights = torch.randn(28, TINY_CONFIG["vocab_size"], generator=g, dtype=torch.float64)
    packed = model(torch.cat(docs)[None], **packed_inputs(docs, "position_ids")).logits[0]
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone, start = [], 0
    for doc in docs:
        logits = model(doc[None]).logits[0]
        (logits * weights[start:start + len(doc)]).sum().backward()
        alone.append(logits.detach())
        start += len(doc)
    torch.testing.assert_close(packed.detach(), torch.cat(alone), rtol=1e-9, atol=1e-9)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_packed_form_and_the_cached_path_give_the_same_logits(layout):
    """``cu_seq_lens_q`` and ``seq_idx`` mark the same documents as ``position_ids``; the packed row in two cached
    calls (split inside the second document) and then token by token gives the full forward's logits; a row whose
    positions never restart is untouched."""
    model = build(layout)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(4, TINY_CONFIG["vocab_size"], (n,), generator=g) for n in (9, 14, 5)]
    ids = torch.cat(docs)[None]
    with torch.no_grad():
        full = model(ids, **packed_inputs(docs, "position_ids")).logits
        for form in ("cu_seq_lens_q", "seq_idx"):
            # rotary positions count on across documents without position_ids: the same scores up to rounding
            torch.testing.assert_close(model(ids, **packed_inputs(docs, form)).logits, full, rtol=1e-9, atol=1e-9)
        positions = packed_inputs(docs, "position_ids")["position_ids"]
        cache = BilinearCache(model.config)
        pieces = [model(ids[:, :15], position_ids=positions[:, :15], cache=cache).logits,
                  model(ids[:, 15:24], position_ids=positions[:, 15:24], cache=cache).logits]
        pieces += [model(ids[:, t:t + 1], position_ids=positions[:, t:t + 1], cache=cache).logits for t in range(24, 28)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
        plain = model(ids).logits
        torch.testing.assert_close(model(ids, position_ids=torch.arange(28)[None]).logits, plain, rtol=0, atol=0)
    assert (plain[0, 9:] - full[0, 9:]).abs().max() > 1e-3  # unpacked, the second document sees the first
    with pytest.raises(ValueError, match="cu_seq_lens_q marks the documents of one packed row, but the batch has 2 "
                                         "rows"):
        model(ids.expand(2, -1), **packed_inputs(docs, "cu_seq_lens_q"))


def test_hf_trainer_with_the_flattening_collator_trains_as_the_padded_batch(tmp_path):
    """transformers' ``Trainer`` with ``DataCollatorWithFlattening`` (documents in one row, positions restarting)
    trains to the same losses, step by step, as with the same documents padded into a batch."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(4, TINY_CONFIG["vocab_size"], (int(n),), generator=g).tolist()
            for n in torch.randint(5, 17, (12,), generator=g)]
    dataset = Dataset.from_dict({"input_ids": docs})

    def padded(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    losses = []
    for collator in (DataCollatorWithFlattening(), padded):
        args = TrainingArguments(output_dir=str(tmp_path / str(len(losses))), per_device_train_batch_size=4,
                                 max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
                                 save_strategy="no", seed=0, disable_tqdm=True)
        trainer = Trainer(model=build("hybrid").float().train(), args=args, train_dataset=dataset,
                          data_collator=collator)
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert len(losses[0]) == 3
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-4, atol=1e-5)
