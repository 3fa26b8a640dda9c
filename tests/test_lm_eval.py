"""lm-eval-harness integration: local offline tasks (wikitext2_local, lambada_openai_local), the
in-memory entry point bilinear_lm.evaluation.harness.run_lm_eval, agreement with
bilinear_lm.evaluation.perplexity and an independent LAMBADA computation (for the bilinear models, Llama and the
peers of issue 47), and one run of the stock `lm_eval` CLI on a saved checkpoint."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bilinear_lm.evaluation import perplexity as ppl
from bilinear_lm.evaluation.harness import TASKS_DIR, run_lm_eval
from bilinear_lm.evaluation.lm_eval_tasks import bilinear_local_utils as local
from fixtures import TINY_CONFIGS, build_tiny_model, cached_tokenizer, save_tiny_checkpoint

MODEL_TYPES = ["llama", "bilinear", "hybrid", "gated_deltanet", "mamba2"]
HYBRID = dict(layer_types=["bilinear", "sliding_attention"], sliding_window=16)  # a window: streaming stays exact
PEERS = {"gated_deltanet": dict(allow_neg_eigval=True), "mamba2": {}}  # sized like the tiny bilinear model
N_WIKI, N_LAMBADA = 3, 6


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def small_data_dir():
    """The tests' data folder (tests/data): the layout and formats of the tasks' real data folder, a few KB written
    from Tiny Shakespeare by tests/data/make_data.py; N_WIKI + 1 test articles and N_LAMBADA + 2 passages, so the
    limits below leave some out."""
    from conftest import TEST_DATA

    return TEST_DATA


@pytest.fixture(scope="module")
def cli_run(tokenizer, small_data_dir, tmp_path_factory):
    """Launch the stock CLI once, in the background, as soon as the module starts (it spends ~15 s
    indexing lm-eval's built-in tasks); test_stock_lm_eval_cli_on_saved_checkpoint waits for it.
    `lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --include_path ...
    --metadata '{"data_dir": ...}'` on a saved bilinear checkpoint, with $BILINEAR_LM_DATA_DIR unset."""
    tmp = tmp_path_factory.mktemp("lm_eval_cli")
    ckpt = save_tiny_checkpoint(tmp / "ckpt", "bilinear", tokenizer=tokenizer, seed=4)
    exe = Path(sys.executable).with_name("lm_eval")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lm_eval"]
    out_dir = tmp / "results"
    cmd += ["--model", "hf", "--model_args", f"pretrained={ckpt},trust_remote_code=True",
            "--tasks", "wikitext2_local,lambada_openai_local", "--include_path", str(TASKS_DIR),
            "--limit", "2", "--device", "cpu", "--batch_size", "2", "--output_path", str(out_dir)]
    cmd += ["--metadata", json.dumps({"data_dir": str(small_data_dir)})]  # the explicit argument, not the env var
    env = {k: v for k, v in os.environ.items() if k != local.DATA_ENV}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1"})
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
        if model_type in PEERS:
            from bilinear_lm.baselines import build_model

            torch.manual_seed(3)
            _MODELS[model_type] = build_model(model_type, {**TINY_CONFIGS["bilinear"], **PEERS[model_type]},
                                              vocab_size).eval()
        elif model_type == "hybrid":
            _MODELS[model_type] = build_tiny_model("bilinear", vocab_size, seed=3, **HYBRID)
        else:
            _MODELS[model_type] = build_tiny_model(model_type, vocab_size, seed=3)
    return _MODELS[model_type]


def all_finite(metrics: dict) -> bool:
    """Every metric of every task of run_lm_eval's summary is finite."""
    return all(math.isfinite(v) for task in metrics.values() for v in task.values())


# ----------------------------------------------------------------------------- loaders
def test_local_loaders_split_the_test_data_into_articles(small_data_dir, monkeypatch):
    """tests/data as make_data.py writes it (test_the_test_data_is_made_from_tiny_shakespeare): the test split's
    articles start at its 4 top-level headings, the validation split's at its 2; sections and subsections stay inside
    their article, and nothing is lost but the whitespace line before the first heading."""
    monkeypatch.setenv(local.DATA_ENV, str(small_data_dir))
    wiki = local.load_wikitext2()
    assert (len(wiki["validation"]), len(wiki["test"])) == (2, N_WIKI + 1)
    titles = [p.splitlines()[0] for p in wiki["test"]["page"]]
    assert titles == [" = First Citizen = ", " = Messenger = ", " = VIRGILIA = ", " = COMINIUS = "]
    assert [p.count(" = = = ") for p in wiki["test"]["page"]] == [2, 2, 4, 0]  # subsections (opening and closing)
    assert wiki["validation"][0]["page"].startswith(" = Third Citizen = \n \n Third Citizen : But this ")
    raw = (small_data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    assert raw.startswith(" \n = First Citizen = \n")
    assert "".join(wiki["test"]["page"]) == raw[len(" \n"):]  # nothing lost
    assert all(p.startswith(" = ") and not p.startswith(" = = ") for p in wiki["test"]["page"])
    lam = local.load_lambada_openai()
    assert len(lam["test"]) == N_LAMBADA + 2
    assert lam["test"][0]["text"].startswith("One word more, one word. This tiger-footed rage")
    # an explicit data_dir (lm_eval --metadata '{"data_dir": ...}') wins over the environment
    monkeypatch.setenv(local.DATA_ENV, "/no/such/dir")
    assert local.load_wikitext2(data_dir=str(small_data_dir))["test"]["page"] == wiki["test"]["page"]
    assert local.load_lambada_openai(data_dir=str(small_data_dir), version=1.0)["test"]["text"] == lam["test"]["text"]


def test_the_test_data_is_made_from_tiny_shakespeare(small_data_dir):
    """tests/data is exactly make_data.py's output from the packaged Tiny Shakespeare (public domain): every file
    byte for byte, and no other file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", small_data_dir / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    files = make_data.build(make_data.source_text())
    on_disk = {p.relative_to(small_data_dir).as_posix() for p in small_data_dir.rglob("*")
               if p.is_file() and p.name != "make_data.py" and "__pycache__" not in p.parts}
    assert on_disk == set(files)
    for rel, content in files.items():
        assert (small_data_dir / rel).read_bytes() == content.encode("utf-8"), rel
    # the LAMBADA property: each passage's target, its last word, occurs earlier in the passage
    for line in files["lambada/lambada_test.jsonl"].splitlines():
        *context, target = json.loads(line)["text"].split(" ")
        assert target.isalpha() and target in re.findall(r"[A-Za-z']+", " ".join(context))


def test_loader_errors_name_the_env_var_and_the_layout(small_data_dir, tmp_path, monkeypatch):
    """One line each, naming what to set and the files it needs; no default folder is tried (not even a complete
    ../shared/data beside the current directory, the old default)."""
    import shutil

    monkeypatch.delenv(local.DATA_ENV, raising=False)
    shutil.copytree(small_data_dir, tmp_path / "shared" / "data")
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    for load in (local.load_wikitext2, local.load_lambada_openai):
        with pytest.raises(FileNotFoundError, match=rf"set {local.DATA_ENV}=DIR .*data_dir.*wikitext-2-raw/"
                                                    r"wiki.test.raw and lambada/lambada_test.jsonl") as e:
            load()
        assert "\n" not in str(e.value) and "shared" not in str(e.value)
    monkeypatch.setenv(local.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=rf"{local.DATA_ENV}=.*nowhere: no such directory; it must hold wiki"):
        local.load_wikitext2()
    with pytest.raises(FileNotFoundError, match=r"^data_dir=.*nowhere: no such directory"):
        local.load_lambada_openai(data_dir=str(tmp_path / "nowhere"))
    monkeypatch.setenv(local.DATA_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"lambada_test.jsonl not found: .*{local.DATA_ENV}"):
        local.load_lambada_openai()
    with pytest.raises(FileNotFoundError, match="wiki.valid.raw not found"):
        local.load_wikitext2()


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
    per document == streaming with the recurrent state carried across 37-token segments; the peers (Gated
    DeltaNet[-1,1] and Mamba2 through the factory, transformers' code) with one window == one forward per document."""
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
        elif model_type in PEERS:
            nll += ppl.strided_perplexity(model, ids, ids.numel(), stride=ids.numel() - 1)[0]
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
