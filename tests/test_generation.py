"""The real ``model.generate()`` against full forward passes (the recurrent cache must be exact)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from bilinear_lm import BilinearCache, BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling.modeling_bilinear import BilinearShortConv
from bilinear_lm.modeling.transformers_compat import returned_cache

PAD = 0


HYBRIDS = [{"layer_types": ["bilinear", "full_attention"], "conv_width": 3, "num_key_value_heads": 2},
           {"layer_types": ["sliding_attention", "bilinear"], "sliding_window": 4}]


MEMORY = {"conv_width": 3, "memory_heads": 2, "memory_key_size": 4, "memory_value_size": 3}


@pytest.fixture(params=[{}, {"conv_width": 3}, MEMORY, *HYBRIDS], ids=["pure", "conv3", "memory", "hybrid",
                                                                        "hybrid-sliding"])
def model(request, tiny_bilinear_config):
    """The tiny model, the same with what adds cached state (convolutions, memory heads; the convolutions get random
    weights: at init they are the identity, which would hide a wrong cache), and hybrids with a full or sliding
    attention layer."""
    torch.manual_seed(0)
    tiny_bilinear_config.pad_token_id = PAD
    for key, value in request.param.items():
        setattr(tiny_bilinear_config, key, value)
    model = BilinearForCausalLM(tiny_bilinear_config).double().eval()
    for module in model.modules():
        if isinstance(module, BilinearShortConv):
            torch.nn.init.normal_(module.weight, std=0.5)
    return model


def argmax_loop(model, ids, steps):
    """Greedy decoding by re-running the full forward each step (no cache)."""
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_greedy_generate_equals_argmax_loop(model):
    prompt = torch.randint(1, model.config.vocab_size, (3, 9))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, argmax_loop(model, prompt, 12))


def test_left_padded_batch_generates_its_rows_alone(model):
    rows = [torch.randint(1, model.config.vocab_size, (1, n)) for n in (11, 4, 7)]
    width = max(r.shape[1] for r in rows)
    batch = torch.full((3, width), PAD)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, width - r.shape[1]:] = r
        mask[i, width - r.shape[1]:] = 1
    out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for i, r in enumerate(rows):
        alone = model.generate(r, max_new_tokens=8, do_sample=False)
        assert torch.equal(out[i, width:], alone[0, r.shape[1]:])


def test_teacher_forced_scores_equal_full_forward_logits(model):
    prompt = torch.randint(1, model.config.vocab_size, (2, 6))
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, output_scores=True,
                         output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits.double(), full[:, prompt.shape[1] - 1 + step], rtol=1e-6, atol=1e-6)
    assert isinstance(returned_cache(out), BilinearCache)
    assert returned_cache(out).get_seq_length() == out.sequences.shape[1] - 1


def test_prefill_then_cached_steps_equal_full_forward(model):
    ids = torch.randint(1, model.config.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :17], use_cache=True)
        pieces = [out.logits]
        cache = returned_cache(out)
        for t in range(17, 30):
            step = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


def test_beam_search_runs_and_beats_or_ties_greedy(model):
    torch.manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (3, 5))
    beams = model.generate(prompt, max_new_tokens=8, num_beams=4, do_sample=False, length_penalty=0.0,
                           output_scores=True, return_dict_in_generate=True)
    greedy = model.generate(prompt, max_new_tokens=8, do_sample=False)

    def logprob(seqs):
        with torch.no_grad():
            logp = model(seqs).logits.log_softmax(-1)[:, 4:-1]
        return logp.gather(-1, seqs[:, 5:, None]).sum((1, 2))

    assert beams.sequences.shape == (3, 13)
    assert (logprob(beams.sequences) >= logprob(greedy) - 1e-9).all()
    torch.testing.assert_close(beams.sequences_scores.double(), logprob(beams.sequences), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def remote_code_run(tmp_path_factory):
    """test_remote_code_loads_without_the_package's process, started at module start (the other tests run meanwhile):
    the tiny model with memory heads (every module of the model: their recurrence is a file of its own) and
    test_hybrid's 4-layer hybrid (left-padded rows) saved with their logits and greedy continuations, and a Python
    without bilinear_lm that loads each with trust_remote_code and compares (the first compiled too)."""
    from conftest import TINY_CONFIG
    from test_hybrid import build, hybrid_config, left_padded

    root = tmp_path_factory.mktemp("remote_code")
    config = BilinearConfig(**{**TINY_CONFIG, **MEMORY})
    torch.manual_seed(0)
    models = {"pure": (AutoModelForCausalLM.from_config(config).eval(), torch.randint(0, config.vocab_size, (2, 9)),
                       None),
              "hybrid": (build(hybrid_config(config)).float(), *left_padded(60, [9, 6]))}
    expected = {}
    for name, (model, ids, mask) in models.items():
        model.save_pretrained(root / name)
        with torch.no_grad():
            expected[name] = {"ids": ids, "mask": mask, "logits": model(ids, attention_mask=mask).logits,
                              "gen": model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)}
    torch.save(expected, root / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["bilinear_lm"] = None  # the package is not importable here
        import torch
        from transformers import AutoModelForCausalLM
        try:
            import bilinear_lm
            raise SystemExit("bilinear_lm should not be importable")
        except ImportError:
            pass
        for name, expected in torch.load({str(root / 'expected.pt')!r}).items():
            model = AutoModelForCausalLM.from_pretrained({str(root)!r} + "/" + name, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            dispatch = sys.modules[type(model).__module__.rpartition(".")[0] + ".dispatch"]
            assert dispatch.load_cpu_kernels is None  # no compiled kernels without the package: the PyTorch scan runs
            ids, mask = expected["ids"], expected["mask"]
            with torch.no_grad():
                torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected["logits"], rtol=1e-5,
                                           atol=1e-6)
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            assert torch.equal(gen, expected["gen"]), name
            if name == "pure":  # the compiled decoding step needs no kernels of the package either
                assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                                  cache_implementation="static"), expected["gen"])
                assert hasattr(model, "_compiled_call")
            print("ok", name)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HF_HOME": str(root / "hf_home"), "HF_HUB_OFFLINE": "1"})
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_remote_code_loads_without_the_package(remote_code_run):
    out, err = remote_code_run.communicate(timeout=300)
    assert remote_code_run.returncode == 0 and out == "ok pure\nok hybrid\n", err[-3000:]


def test_the_cache_is_taken_by_either_name_and_nothing_of_ours_warns(model, monkeypatch):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns where the old name is used (a
    FutureWarning from its decorator, a logged warning from the outputs' old field). The model, ``generate`` (greedy,
    beam search) and reading the returned cache use the installed version's name: nothing warns. A user's
    ``past_key_values`` is still taken (5.23's name; deprecated on 5.24, as transformers' own models say)."""
    import logging
    import warnings

    from bilinear_lm.modeling.transformers_compat import CACHE_NAME

    said = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, message, *args, **kwargs: said.append(message))
    ids = torch.randint(1, model.config.vocab_size, (2, 9))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert isinstance(returned_cache(out), BilinearCache)
        model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
        cache = returned_cache(model(ids[:, :5], use_cache=True))
        expected = model(ids[:, 5:], cache=cache).logits
    said += [str(warning.message) for warning in caught]
    assert not [message for message in said if "past_key_values" in str(message)], said
    with torch.no_grad():
        cache = returned_cache(model(ids[:, :5], use_cache=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old_name = model(ids[:, 5:], past_key_values=cache).logits
    assert torch.equal(old_name, expected)
    warned = any("`past_key_values` is deprecated" in str(warning.message) for warning in caught)
    assert warned == (CACHE_NAME == "cache")
