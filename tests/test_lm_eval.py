"""lm-eval-harness integration: local offline tasks (wikitext2_local, lambada_openai_local), the
in-memory entry point bilinear_lm.evaluation.harness.run_lm_eval, agreement with
bilinear_lm.evaluation.perplexity and an
independent LAMBADA computation, and one run of the stock `lm_eval` CLI on a saved checkpoint."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bilinear_lm.evaluation import perplexity as ppl
from bilinear_lm.evaluation.harness import TASKS_DIR, run_lm_eval
from bilinear_lm.evaluation.lm_eval_tasks import bilinear_local_utils as local
from fixtures import build_tiny_model, cached_tokenizer, save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
MODEL_TYPES = ["llama", "bilinear", "hybrid"]
HYBRID = dict(layer_types=["bilinear", "sliding_attention"], sliding_window=16)  # a window: streaming stays exact
N_WIKI, N_LAMBADA = 3, 6


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def small_data_dir(tmp_path_factory):
    """A BILINEAR_LM_DATA_DIR with the same layout and format as ../shared/data, but short: the first
    articles of each WikiText split cut to a few lines, and the first LAMBADA passages."""
    from conftest import DATA_DIR

    root = tmp_path_factory.mktemp("lm_eval_data")
    (root / "wikitext-2-raw").mkdir()
    (root / "lambada").mkdir()
    for name in ("wiki.valid.raw", "wiki.test.raw"):
        raw = (DATA_DIR / "wikitext-2-raw" / name).read_text(encoding="utf-8")
        arts = local.split_wikitext_articles(raw)[:N_WIKI + 1]
        short = [" \n" + "".join(a.splitlines(keepends=True)[: 3 + 2 * i])[: 600 + 500 * i] + "\n \n"
                 for i, a in enumerate(arts)]
        (root / "wikitext-2-raw" / name).write_text("".join(short), encoding="utf-8")
    lines = (DATA_DIR / "lambada" / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "lambada" / "lambada_test.jsonl").write_text("".join(lines[:N_LAMBADA + 2]), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def cli_run(tokenizer, small_data_dir, tmp_path_factory):
    """Launch the stock CLI once, in the background, as soon as the module starts (it spends ~15 s
    indexing lm-eval's built-in tasks); test_stock_lm_eval_cli_on_saved_checkpoint waits for it.
    `lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --include_path ...`
    on a saved bilinear checkpoint."""
    tmp = tmp_path_factory.mktemp("lm_eval_cli")
    ckpt = save_tiny_checkpoint(tmp / "ckpt", "bilinear", tokenizer=tokenizer, seed=4)
    exe = Path(sys.executable).with_name("lm_eval")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lm_eval"]
    out_dir = tmp / "results"
    cmd += ["--model", "hf", "--model_args", f"pretrained={ckpt},trust_remote_code=True",
            "--tasks", "wikitext2_local,lambada_openai_local", "--include_path", str(TASKS_DIR),
            "--limit", "2", "--device", "cpu", "--batch_size", "2", "--output_path", str(out_dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", local.DATA_ENV: str(small_data_dir)}
    log = open(tmp / "log.txt", "w+")
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    yield {"proc": proc, "out_dir": out_dir, "log": log, "model_type": "bilinear"}
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module", autouse=True)
def _start_cli_early(request):
    if any("stock_lm_eval_cli" in item.name for item in request.session.items):
        request.getfixturevalue("cli_run")


_MODELS = {}


def get_model(model_type, vocab_size):
    if model_type not in _MODELS:
        _MODELS[model_type] = build_tiny_model("bilinear", vocab_size, seed=3, **HYBRID) if model_type == "hybrid" \
            else build_tiny_model(model_type, vocab_size, seed=3)
    return _MODELS[model_type]


def all_finite(metrics: dict) -> bool:
    """Every metric of every task of run_lm_eval's summary is finite."""
    return all(math.isfinite(v) for task in metrics.values() for v in task.values())


# ----------------------------------------------------------------------------- loaders
def test_local_loaders_on_real_data(data_dir, monkeypatch):
    monkeypatch.delenv(local.DATA_ENV, raising=False)  # default: ../shared/data from the current directory
    monkeypatch.chdir(REPO)
    wiki = local.load_wikitext2()
    # EleutherAI/wikitext_document_level wikitext-2-raw-v1 has 60 validation and 62 test pages
    assert (len(wiki["validation"]), len(wiki["test"])) == (60, 62)
    assert wiki["test"][0]["page"].startswith(" = Robert Boulter = \n")
    assert wiki["validation"][0]["page"].startswith(" = Homarus gammarus = \n")
    raw = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    assert "".join(wiki["test"]["page"]) == raw[raw.index(" = Robert Boulter"):]  # nothing lost
    assert all(p.startswith(" = ") and not p.startswith(" = = ") for p in wiki["test"]["page"])
    lam = local.load_lambada_openai()
    assert len(lam["test"]) == 5153


def test_loader_errors_name_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv(local.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=local.DATA_ENV):
        local.load_wikitext2()
    monkeypatch.setenv(local.DATA_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="lambada_test.jsonl"):
        local.load_lambada_openai()


def test_run_lm_eval_bad_include_path(tokenizer):
    with pytest.raises(ValueError, match="include_path"):
        run_lm_eval(get_model("llama", len(tokenizer)), tokenizer, ["wikitext2_local"], include_path="/no/such/dir")


# ----------------------------------------------------------------------------- agreement
def lambada_reference(model, tokenizer, texts):
    """Independent LAMBADA scoring: one forward over context+" last_word" (no prefix token, as
    lm-eval does for a non-empty context); continuation tokens = whole[len(context tokens):]."""
    lls, greedy = [], []
    for text in texts:
        words = text.split(" ")
        context, cont = " ".join(words[:-1]), " " + words[-1]
        whole = tokenizer(context + cont, add_special_tokens=False)["input_ids"]
        n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        ids = torch.tensor(whole)
        with torch.no_grad():
            logits = model(input_ids=ids[:-1].unsqueeze(0)).logits[0].double()
        logp = torch.log_softmax(logits[n_ctx - 1:], -1)
        target = ids[n_ctx:]
        lls.append(float(logp.gather(1, target[:, None]).sum()))
        greedy.append(bool((logp.argmax(-1) == target).all()))
    return math.exp(-sum(lls) / len(lls)), sum(greedy) / len(greedy)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lm_eval_agrees_with_perplexity_module(model_type, tokenizer, small_data_dir, monkeypatch):
    """lm-eval's rolling loglikelihood (right-padded batches of windows from documents of different
    lengths) equals bilinear_lm.evaluation.perplexity on the same tokens: llama with 48-token windows ==
    rolling_perplexity(max_length=48); bilinear (and a hybrid with a sliding-window attention layer) with one window
    per document == streaming with the recurrent state carried across 37-token segments."""
    monkeypatch.setenv(local.DATA_ENV, str(small_data_dir))
    model = get_model(model_type, len(tokenizer))
    window = 48 if model_type == "llama" else 100_000
    wiki = run_lm_eval(model, tokenizer, ["wikitext2_local"], limit=N_WIKI, batch_size=3, max_length=window)
    lam = run_lm_eval(model, tokenizer, ["lambada_openai_local"], limit=N_LAMBADA, batch_size=4, max_length=2048)
    assert all_finite(wiki) and all_finite(lam)
    assert model.training is False

    pages = local.load_wikitext2()["test"]["page"][:N_WIKI]
    nll = words = n_bytes = 0
    for page in pages:
        ids = ppl.encode_text(tokenizer, local.wikitext_detokenizer({"page": page}))
        if model_type == "llama":
            assert ids.numel() > 2 * window  # several windows per document
            nll += ppl.rolling_perplexity(model, ids, window)[0]
        else:
            nll += ppl.streaming_perplexity(model, ids, segment_len=37)[0]
        stats = ppl.text_stats(page)
        words, n_bytes = words + stats["words"], n_bytes + stats["bytes"]
    w = wiki["wikitext2_local"]
    lm_eval_nll = math.log(w["word_perplexity"]) * words
    print(f"{model_type}: nll perplexity {nll:.6f} lm-eval {lm_eval_nll:.6f}")
    assert lm_eval_nll == pytest.approx(nll, abs=2e-3)  # float32 rounding only (a token is ~6 nats)
    assert w["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert w["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-5)
    assert w["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)

    texts = local.load_lambada_openai()["test"]["text"][:N_LAMBADA]
    ref_ppl, ref_acc = lambada_reference(model, tokenizer, texts)
    print(f"{model_type}: lambada ppl {lam['lambada_openai_local']['perplexity']:.6f} ref {ref_ppl:.6f}")
    assert lam["lambada_openai_local"]["perplexity"] == pytest.approx(ref_ppl, rel=1e-5)
    assert lam["lambada_openai_local"]["acc"] == pytest.approx(ref_acc)


# ----------------------------------------------------------------------------- stock CLI
def test_stock_lm_eval_cli_on_saved_checkpoint(cli_run):
    proc, out_dir, log = cli_run["proc"], cli_run["out_dir"], cli_run["log"]
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("lm_eval CLI did not finish within 240 s")
    log.seek(0)
    output = log.read()
    assert rc == 0, output[-3000:]
    files = sorted(out_dir.rglob("results_*.json"))
    assert files, f"no results json under {out_dir}: {output[-2000:]}"
    results = json.loads(files[-1].read_text())["results"]
    assert math.isfinite(results["wikitext2_local"]["word_perplexity,none"])
    assert math.isfinite(results["wikitext2_local"]["bits_per_byte,none"])
    assert math.isfinite(results["lambada_openai_local"]["perplexity,none"])
    assert 0.0 <= results["lambada_openai_local"]["acc,none"] <= 1.0
