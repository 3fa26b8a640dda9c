"""bilinear_lm.evaluation.perplexity: streaming (recurrent state carried) and strided protocols vs independent
references (one naive fp64 forward; per-token brute force), metric definitions, CLI and errors."""
import copy
import json
import math
import re

import pytest
import torch

from bilinear_lm.evaluation import perplexity as ppl
from bilinear_lm.modeling.transformers_compat import returned_cache
from fixtures import build_tiny_model, cached_tokenizer, save_tiny_checkpoint

MODEL_TYPES = ["llama", "bilinear"]


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def text():
    """The first 700 characters of the tests' WikiText-format file (Tiny Shakespeare; headings with an en dash, so
    UTF-8 bytes outnumber characters)."""
    from conftest import TEST_DATA

    raw = (TEST_DATA / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:700]
    assert len(raw) == 700 and len(raw.encode("utf-8")) > 700
    return raw


@pytest.fixture(scope="module")
def ids(tokenizer, text):
    out = ppl.encode_text(tokenizer, text)
    assert 150 < out.numel() < 600
    return out


_MODELS = {}


def get_model(model_type, vocab_size):
    if model_type not in _MODELS:
        _MODELS[model_type] = build_tiny_model(model_type, vocab_size, seed=1).double()
    return _MODELS[model_type]


def naive_nll(model, ids):
    """Reference: one forward pass over all tokens, fp64 log-softmax, sum of -log p(next token)."""
    with torch.no_grad():
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return float(-logp.gather(1, ids[1:, None]).sum()), ids.numel() - 1


def test_encode_text_prefix_and_roundtrip(tokenizer, text, ids):
    assert ids[0].item() == tokenizer.convert_tokens_to_ids("<|endoftext|>")  # train.py's BPE: BOS = EOS
    assert tokenizer.decode(ids[1:].tolist()) == text  # byte-level BPE is lossless
    # prefix = BOS, else EOS (lm-eval's rule)
    bos_only, eos_only = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    bos_only.bos_token, bos_only.eos_token, eos_only.bos_token = "a", None, None
    assert ppl.encode_text(bos_only, "x")[0] == tokenizer.convert_tokens_to_ids("a")
    assert ppl.encode_text(eos_only, "x")[0] == tokenizer.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_strided_full_window_equals_naive_forward(model_type, tokenizer, ids):
    model = get_model(model_type, len(tokenizer))
    ref, n = naive_nll(model, ids)
    for max_length, stride in [(ids.numel(), ids.numel() - 1), (ids.numel() + 50, 7)]:
        nll, count = ppl.strided_perplexity(model, ids, max_length, stride)
        assert count == n
        assert nll == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_strided_windows_match_per_token_brute_force(model_type, tokenizer, ids):
    """Each token t is scored once, in the first window k (begin k*S, end k*S+M) with end > t,
    conditioned on ids[k*S:t]; brute force: one forward per token on exactly that context."""
    model = get_model(model_type, len(tokenizer))
    x = ids[:40]
    M, S = 14, 5
    ref = 0.0
    with torch.no_grad():
        for t in range(1, x.numel()):
            k = max(0, (t - M) // S + 1)
            ctx = x[k * S : t]
            logits = model(input_ids=ctx.unsqueeze(0)).logits[0, -1].double()
            ref -= float(torch.log_softmax(logits, -1)[x[t]])
    nll, count = ppl.strided_perplexity(model, x, M, S)
    assert count == x.numel() - 1
    assert nll == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_rolling_windows_match_per_token_brute_force(model_type, tokenizer, ids):
    """lm-eval's rolling windows: token t is in window k = (t-1)//L (targets [1+kL, min(1+(k+1)L, T)));
    the window's inputs start at max(0, end-1-L) (the last window is left-extended)."""
    model = get_model(model_type, len(tokenizer))
    x = ids[:38]
    L = 8
    ref = 0.0
    with torch.no_grad():
        for t in range(1, x.numel()):
            s = 1 + ((t - 1) // L) * L
            e = min(s + L, x.numel())
            ctx = x[max(0, e - 1 - L) : t]
            assert ctx.numel() <= L
            logits = model(input_ids=ctx.unsqueeze(0)).logits[0, -1].double()
            ref -= float(torch.log_softmax(logits, -1)[x[t]])
    nll, count = ppl.rolling_perplexity(model, x, L)
    assert count == x.numel() - 1
    assert nll == pytest.approx(ref, rel=1e-9)
    full, _ = naive_nll(model, x)
    assert ppl.rolling_perplexity(model, x, x.numel())[0] == pytest.approx(full, rel=1e-9)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("segment_len", [1, 7, 64, 10_000])
def test_streaming_state_equals_full_forward(model_type, segment_len, tokenizer, ids):
    """Carrying the cache across segments is exact. For the recurrent model this is the O(1)
    state; llama only passes with allow_kv_cache (its KV cache is exact but grows)."""
    model = get_model(model_type, len(tokenizer))
    x = ids[:60] if segment_len == 1 else ids
    ref, n = naive_nll(model, x)
    nll, count = ppl.streaming_perplexity(model, x, segment_len, allow_kv_cache=(model_type == "llama"))
    assert count == n
    assert nll == pytest.approx(ref, rel=1e-9)


def test_bilinear_cache_is_recurrent(tokenizer, ids):
    model = get_model("bilinear", len(tokenizer))
    with torch.no_grad():
        out = model(input_ids=ids[:10].unsqueeze(0), use_cache=True)
    assert ppl.cache_kind(model, returned_cache(out)) == "recurrent"


def test_streaming_rejects_attention_model(tokenizer, ids):
    model = get_model("llama", len(tokenizer))
    with pytest.raises(ValueError, match="--mode strided"):
        ppl.streaming_perplexity(model, ids, segment_len=32)


def test_bad_arguments(tokenizer, ids):
    model = get_model("llama", len(tokenizer))
    with pytest.raises(ValueError, match="stride"):
        ppl.strided_perplexity(model, ids, max_length=16, stride=16)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ppl.strided_perplexity(model, ids[:1], max_length=16, stride=8)
    with pytest.raises(ValueError, match="segment_len"):
        ppl.streaming_perplexity(model, ids, segment_len=0)


@pytest.mark.parametrize("protocol", ["streaming", "strided", "rolling"])
@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_out_of_range_ids_name_the_id_and_the_vocabulary(protocol, bad_id, tokenizer, ids):
    model = get_model("bilinear", len(tokenizer))
    vocab = model.get_input_embeddings().num_embeddings
    bad = ids[:20].clone()
    bad[7] = vocab if bad_id == "vocab" else bad_id
    run = {"streaming": lambda x: ppl.streaming_perplexity(model, x, 8),
           "strided": lambda x: ppl.strided_perplexity(model, x, 16, 8),
           "rolling": lambda x: ppl.rolling_perplexity(model, x, 16)}[protocol]
    with pytest.raises(ValueError, match=rf"token id {bad[7]} at position 7 .* vocabulary of {vocab} ids .*tokenizer"):
        run(bad)


def test_empty_inputs_are_value_errors(tokenizer):
    model = get_model("bilinear", len(tokenizer))
    with pytest.raises(ValueError, match="at least 2 tokens.*got 0"):
        ppl.streaming_perplexity(model, [], 8)
    with pytest.raises(ValueError, match="zero tokens.*non-empty text"):
        ppl.evaluate_text(model, tokenizer, "")


def test_metric_definitions_match_lm_eval_wikitext():
    from lm_eval.tasks.wikitext.preprocess_wikitext import process_results

    page = " = T = \n \n Some words , here . \n"
    stats = ppl.text_stats(page)
    lm = process_results({"page": page}, [-12.5])
    assert stats["words"] == lm["word_perplexity"][1] == len(re.split(r"\s+", page))
    assert stats["bytes"] == lm["bits_per_byte"][1] == len(page.encode())
    m = ppl.perplexity_metrics(12.5, 5, stats["words"], stats["bytes"])
    assert m["token_perplexity"] == pytest.approx(math.exp(12.5 / 5))
    assert m["word_perplexity"] == pytest.approx(math.exp(12.5 / stats["words"]))
    assert m["bits_per_byte"] == pytest.approx(12.5 / stats["bytes"] / math.log(2))
    assert m["byte_perplexity"] == pytest.approx(2 ** m["bits_per_byte"])
    assert ppl.text_stats("é x")["bytes"] == 4  # bytes are UTF-8 bytes, not characters


# ----------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ppl_ckpt")
    return {name: save_tiny_checkpoint(root / name, name, tokenizer=tokenizer, seed=2) for name in MODEL_TYPES}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("ppl_text") / "t.txt"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cli_writes_table_and_json(model_type, ckpts, text_file, text, tmp_path, capsys):
    out = tmp_path / "r.json"
    ppl.main(["--model", str(ckpts[model_type]), "--file", str(text_file), "--mode", "both",
              "--segment_len", "50", "--max_length", "64", "--stride", "32", "--output", str(out)])
    printed = capsys.readouterr()
    assert "word_ppl" in printed.out and "bits_per_byte" in printed.out
    res = json.loads(out.read_text())["results"]
    expected_modes = {"strided", "streaming"} if model_type == "bilinear" else {"strided"}
    assert set(res) == expected_modes
    if model_type == "llama":
        assert "streaming skipped" in printed.err and "--mode strided" in printed.err
    # independent recomputation from the saved checkpoint, loaded with transformers: every token t is scored
    # by an fp64 forward over the context of the first window that scores it (windows of 64, stride 32): window k's
    # tokens by one forward from 32k (the logits at t - 1 are a causal model's over x[32k : t])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpts[model_type], dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(ckpts[model_type])
    x = [tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    windows = {}
    for t in range(1, len(x)):
        windows.setdefault(max(0, (t - 64) // 32 + 1), []).append(t)
    nll = 0.0
    with torch.no_grad():
        for k, scored in windows.items():
            logp = torch.log_softmax(model(input_ids=torch.tensor([x[k * 32 : scored[-1]]])).logits[0], -1)
            nll -= sum(float(logp[t - 1 - k * 32, x[t]]) for t in scored)
    r = res["strided"]
    words, n_bytes = len(re.split(r"\s+", text)), len(text.encode("utf-8"))
    assert (r["tokens"], r["words"], r["bytes"]) == (len(x) - 1, words, n_bytes)
    assert r["nll"] == pytest.approx(nll, rel=1e-5)  # the CLI runs the model in float32
    assert r["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)
    if model_type == "bilinear":
        # streaming sees the full context, strided only <= 64 tokens: different but both finite
        assert math.isfinite(res["streaming"]["token_perplexity"])


def test_cli_errors(ckpts, text_file, tmp_path):
    ck = str(ckpts["llama"])
    with pytest.raises(SystemExit, match="--mode strided"):
        ppl.main(["--model", ck, "--file", str(text_file), "--mode", "streaming", "--segment_len", "50"])
    with pytest.raises(SystemExit, match="does not exist"):
        ppl.main(["--model", ck, "--file", str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit, match="does not exist"):
        ppl.main(["--model", str(tmp_path / "no_ckpt"), "--file", str(text_file)])
    # a checkpoint without tokenizer files
    bare = tmp_path / "bare"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ck).save_pretrained(bare)
    with pytest.raises(SystemExit, match="tokenizer"):
        ppl.main(["--model", str(bare), "--file", str(text_file), "--mode", "strided"])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(SystemExit, match="empty"):
        ppl.main(["--model", ck, "--file", str(empty)])
    # a tokenizer with a larger vocabulary than the model's
    small = tmp_path / "small_vocab"
    save_tiny_checkpoint(small, "bilinear", tokenizer=cached_tokenizer(vocab_size=300), seed=2)
    with pytest.raises(SystemExit, match=r"error: token id \d+ at position \d+ is outside the model's vocabulary of "
                                         r"300 ids"):
        ppl.main(["--model", str(small), "--tokenizer", ck, "--file", str(text_file), "--mode", "strided"])


# Mamba2's PyTorch path computes its gated norm and its decays in float32 even in a float64 model, so its streaming
# and its full forward agree to float32's rounding only (4e-9 of the total on an EPYC Zen 5, under 1e-9 on others)
@pytest.mark.parametrize("model_type, rel", [("gated_deltanet", 1e-9), ("mamba2", 1e-6)])
def test_the_recurrent_peers_stream_exactly(model_type, rel, tokenizer, ids):
    """Gated DeltaNet and Mamba2 carry their state across segments: streaming equals one full forward (transformers
    5.23's Mamba2 takes and returns its cache as ``cache_params``, not under the cache argument's name)."""
    from bilinear_lm.baselines import build_model

    torch.manual_seed(1)
    model = build_model(model_type, dict(hidden_size=32, num_hidden_layers=2, num_heads=2, state_size=8, rank=8),
                        len(tokenizer)).double().eval()
    x = ids[:60]
    ref, n = naive_nll(model, x)
    nll, count = ppl.streaming_perplexity(model, x, 7, allow_kv_cache=False)
    assert count == n
    assert nll == pytest.approx(ref, rel=rel)
