"""train.py end to end (as a subprocess, like a user runs it), kill+resume, 2-rank CPU DDP, baselines, errors, the
shipped default text.

The runs use a 40k-character slice of Tiny Shakespeare and a ~20k-parameter bilinear model so that the
whole file stays well under a minute and a half on 2 shared cores.
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bilinear_lm import BilinearForCausalLM
from bilinear_lm.training import DEFAULT_TRAIN_FILE, DataError, TrainingInputError, parse_config, read_metrics

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(DEFAULT_TRAIN_FILE)  # the Tiny Shakespeare text shipped with the package
PRESET = str(REPO / "bilinear_lm" / "configs" / "shakespeare-char.yaml")
MAX_STEPS, SAVE_EVERY, EVAL_EVERY = 30, 5, 10
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def tiny_args(train_file, out_dir, **overrides):
    """train.py's arguments for a tiny run of the shakespeare-char preset (train_file None: the preset's data)."""
    args = {
        "train_file": train_file, "output_dir": out_dir, "max_steps": MAX_STEPS, "block_size": 32,
        "batch_size": 4, "warmup_steps": 5, "log_interval": 1, "eval_interval": EVAL_EVERY, "eval_iters": 0,
        "save_interval": SAVE_EVERY, "sample_tokens": 20, "seed": 7, "learning_rate": 3e-3,
        "model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_heads": 2, "model.state_size": 8,
        "model.rank": 8, "model.norm_chunk_size": 4, **overrides,
    }
    return ["--config", PRESET] + [x for k, v in args.items() if v is not None for x in (f"--{k}", str(v))]


def losses(records, key="loss"):
    return {r["step"]: r[key] for r in records if key in r}


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# run B's killer (Runs._kill_and_resume): SIGKILL to PID once MARKER exists
KILL_AT_MARKER = """
import os, signal, sys, time
marker, pid = sys.argv[1:]
while not os.path.exists(marker):
    time.sleep(0.005)
os.kill(int(pid), signal.SIGKILL)  # B is not reaped until the test waits for it: the pid is still B's
"""


# train.py with hooks (run from the repo) that write every rank's micro-batches to $BATCH_LOG/rank{i}.jsonl, and
# the number of DDP models alive when the process group is destroyed to $BATCH_LOG/teardown{i}.json (see
# bilinear_lm.training.end_training: a DDP model freed after that can deadlock the exit).
RECORD_BATCHES = """
import gc, json, os, sys
import torch
sys.path.insert(0, os.getcwd())
import train
from bilinear_lm.training import micro_batches

def destroy_process_group(group=None, destroy=torch.distributed.destroy_process_group):
    gc.collect()
    alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    with open(os.path.join(os.environ["BATCH_LOG"], f"teardown{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump({"ddp_models_alive": alive}, f)
    destroy(group)

torch.distributed.destroy_process_group = destroy_process_group

def recorded(accelerator, train_dl, state):
    with open(os.path.join(os.environ["BATCH_LOG"], f"rank{accelerator.process_index}.jsonl"), "a") as f:
        for batch in micro_batches(accelerator, train_dl, state):
            f.write(json.dumps({"step": state.step + 1, "input_ids": batch["input_ids"].tolist()}) + "\\n")
            f.flush()
            yield batch

train.micro_batches = recorded
sys.exit(train.cli())
"""


LAUNCHER_NOTICE = re.compile(r"The following values were not passed to `accelerate launch` and had defaults used "
                             r"instead:\n(\t.*\n)+To avoid this warning .* run `accelerate config`\.\n")


README_COMMAND = re.compile(r"^accelerate launch (.*)train\.py (--config bilinear_lm/configs/tiny\.yaml)$", re.M)


def readme_launch(root):
    """The README's command (README_COMMAND) as it is written, on a missing --train_file (ROOT/missing.txt), in the
    background (stdout and stderr apart); None where the README has no such line."""
    import shlex

    command = README_COMMAND.search((REPO / "README.md").read_text())
    if command is None:
        return None
    args = [*shlex.split(command.group(2)), "--train_file", str(root / "missing.txt"), "--output_dir",
            str(root / "readme_out")]
    return subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", *shlex.split(command.group(1)),
                             "train.py", *args], cwd=REPO,
                            env={**ENV, "HF_HOME": str(root / "hf")},  # no accelerate config of this machine's
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Runs:
    """Starts every subprocess at once (they are single-threaded; 2 cores) and lets tests wait for them.

    A: uninterrupted run. B: the identical run, SIGKILLed right after its first checkpoint (a watcher
    process), then resumed with --resume_from_checkpoint latest. DDP: 2-rank CPU DDP for a few steps, recording
    each rank's batches. DDP_FAIL: 2-rank CPU DDP whose main process fails while building the tokenizer (it fails
    within seconds). README: the README's command on a missing --train_file (`readme_launch`).
    """

    def __init__(self, small_text, root):
        import threading

        self.a_dir, self.b_dir, self.ddp_dir = root / "a", root / "b", root / "ddp"
        self.batch_log = root / "ddp_batches"
        self.batch_log.mkdir()
        (root / "record_batches.py").write_text(RECORD_BATCHES)
        self.small_text = small_text
        self.a = self._popen([sys.executable, "train.py", *tiny_args(small_text, self.a_dir)])
        # B keeps every checkpoint (its first one is checked below); resumed with the same options
        self.b = subprocess.Popen([sys.executable, "train.py", *tiny_args(small_text, self.b_dir, save_total_limit=0)],
                                  cwd=REPO,
                                  env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ddp = self._popen(
            self._ddp_launch() + [str(root / "record_batches.py"),
             *tiny_args(small_text, self.ddp_dir, max_steps=4, save_interval=2, eval_interval=2, eval_iters=2,
                        sample_tokens=0)],
            env={**ENV, "ACCELERATE_USE_CPU": "1", "BATCH_LOG": str(self.batch_log)})
        self.ddp_fail = self._popen(
            self._ddp_launch() + ["train.py", *tiny_args(small_text, root / "ddp_fail", tokenizer="/nonexistent/dir")],
            env={**ENV, "ACCELERATE_USE_CPU": "1"})
        self.readme_missing, self.readme = root / "missing.txt", readme_launch(root)
        self.killed_records, self.resumed = None, None
        self.watcher = threading.Thread(target=self._kill_and_resume, daemon=True)
        self.watcher.start()

    @staticmethod
    def _ddp_launch():
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port())]

    @staticmethod
    def _popen(cmd, env=ENV):
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def _kill_and_resume(self):
        """B is killed by a process of its own the moment its first checkpoint is complete: a thread of this one
        could wait for the GIL while the tests run here, and B finished unkilled on a loaded machine."""
        marker = self.b_dir / "checkpoints" / f"step_{SAVE_EVERY}" / "CHECKPOINT_COMPLETE"
        killer = subprocess.Popen([sys.executable, "-c", KILL_AT_MARKER, str(marker), str(self.b.pid)])
        deadline = time.time() + 300
        while killer.poll() is None and self.b.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        killer.kill()
        killer.wait()
        self.b.send_signal(signal.SIGKILL)
        self.b.wait()
        metrics = self.b_dir / "metrics.jsonl"
        self.killed_records = read_metrics(metrics) if metrics.exists() else []
        self.resumed = self._popen([sys.executable, "train.py", *tiny_args(self.small_text, self.b_dir,
                                                                          save_total_limit=0),
                                    "--resume_from_checkpoint", "latest"])

    @staticmethod
    def finish(proc):
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-4000:]
        return out

    def stop(self):
        self.watcher.join(timeout=400)
        for proc in (self.a, self.b, self.ddp, self.ddp_fail, self.readme, self.resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "shakespeare_40k.txt"
    path.write_text(SHAKESPEARE.read_text()[:40_000])
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def runs(small_text, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the in-process tests share the 2 cores with the subprocesses
    runs = Runs(small_text, tmp_path_factory.mktemp("runs"))
    yield runs
    runs.stop()
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------- in-process checks
TINY_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "state_size": 8, "rank": 8,
              "norm_chunk_size": 4}


@pytest.mark.parametrize("model_type", ["bilinear", "llama", "gated_deltanet", "mamba2", "mamba"])
def test_loss_goes_down_on_a_repeated_batch(model_type):
    from bilinear_lm.baselines import build_model

    torch.manual_seed(0)
    model = build_model(model_type, TINY_MODEL, vocab_size=65)
    batch = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(input_ids=batch, labels=batch).loss
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


@pytest.mark.parametrize("model_type", ["llama", "gated_deltanet", "mamba2", "mamba"])
def test_baselines_are_parameter_matched(model_type):
    from bilinear_lm.baselines import build_model, count_parameters

    model_cfg = parse_config(["--config", PRESET]).model
    with torch.device("meta"):
        n_bilinear = count_parameters(build_model("bilinear", model_cfg, vocab_size=65))
        baseline = build_model(model_type, model_cfg, vocab_size=65)
    assert type(baseline).__name__.lower().startswith(model_type.replace("_", ""))
    assert baseline.config.num_hidden_layers == model_cfg["num_hidden_layers"]
    assert abs(count_parameters(baseline) / n_bilinear - 1) < 0.1


def test_lstm_baseline_is_parameter_matched_and_its_loss_is_next_token_cross_entropy():
    from bilinear_lm.baselines import build_model, count_parameters, matched_lstm

    model_cfg = parse_config(["--config", PRESET]).model
    n_bilinear = count_parameters(build_model("bilinear", model_cfg, vocab_size=65))
    lstm = matched_lstm(model_cfg, vocab_size=65)
    assert lstm.lstm.num_layers == model_cfg["num_hidden_layers"]
    assert abs(count_parameters(lstm) / n_bilinear - 1) < 0.05
    ids = torch.randint(0, 65, (2, 9))
    out = lstm(ids, labels=ids)
    manual = -out.logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(out.loss, manual)


def test_gated_deltanet_with_negative_eigenvalues_trains_through_train_py_and_the_option_is_its_own(small_text,
                                                                                                  tmp_path, capsys):
    """``--model_type gated_deltanet --model.allow_neg_eigval true``: train.py trains and saves Gated
    DeltaNet[-1,1], which reloads with the Auto classes as such; the option on another model is a one-line error."""
    from transformers import AutoModelForCausalLM

    import train
    from bilinear_lm.baselines import GatedDeltaNetForCausalLM

    out = tmp_path / "gdn"
    args = tiny_args(small_text, out, model_type="gated_deltanet", max_steps=2, eval_interval=0, save_interval=0,
                     sample_tokens=0)
    assert train.main(args + ["--model.allow_neg_eigval", "true"])["step"] == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, GatedDeltaNetForCausalLM) and model.config.allow_neg_eigval
    capsys.readouterr()
    assert train.cli(tiny_args(small_text, tmp_path / "bilinear", max_steps=2) + ["--model.allow_neg_eigval",
                                                                                  "true"]) == 1
    assert capsys.readouterr().err.endswith("error: --model.*: allow_neg_eigval is a gated_deltanet option; bilinear "
                                            "has no such setting\n")


def test_lstm_trains_saves_reloads_and_generates_through_train_py(small_text, tmp_path):
    """``--model_type lstm``: train.py trains it, save_pretrained / from_pretrained round-trips it (the reload
    reproduces the logged validation loss), and greedy ``generate`` equals an argmax loop over full forwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import train
    from bilinear_lm.baselines import LSTMLanguageModel

    out = tmp_path / "lstm"
    final = train.main(tiny_args(small_text, out, model_type="lstm", max_steps=4, eval_interval=4, save_interval=0,
                                 sample_tokens=5))
    assert final["step"] == 4
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, LSTMLanguageModel) and model.config.num_layers == 2
    text = Path(small_text).read_text()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tok(text[36_000:], add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // 32 * 32].view(-1, 32)
    with torch.no_grad():
        val = torch.stack([model(input_ids=b, labels=b).loss for b in blocks.split(4)]).mean().item()
    assert val == pytest.approx(losses(read_metrics(out / "metrics.jsonl"), "val_loss")[4], abs=1e-4)

    prompt = blocks[:2, :5]
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
        expected = prompt
        for _ in range(6):
            expected = torch.cat([expected, model(expected).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("bad, message", [
    ({"train_file": "/nonexistent/input.txt"}, "does not exist"),
    ({"train_file": "EMPTY"}, "is empty"),
    ({"block_size": 100_000}, "fewer than block_size=100000"),
    ({"tokenizer": "/nonexistent/tokenizer_dir"}, "tokenizer path .* is not a directory"),
    ({"no_such_key": 1}, "unknown argument '--no_such_key'"),
    ({"max_steps": 2.5}, "argument --max_steps/--max-steps: invalid int value: '2.5'"),
    ({"model.conv_width": 1}, "conv_width must be 0"),
    ({"model.vocab_size": 10}, "--model.vocab_size 10 is smaller than the tokenizer"),
    ({"eval_lm_harness": "lambada_openai"}, "--eval_lm_harness needs a tokenizer with an EOS token"),
    ({"add_eos": "true"}, r"EOS after every row \(--add_eos true.*\) needs a tokenizer with an EOS token"),
    ({"tokenizer": "GAPPED"}, r"token id 67 in the train data is outside the model's vocabulary of 58 ids .*"
                              r"pass --model.vocab_size 68"),
])
def test_bad_inputs_fail_with_clear_errors(small_text, tmp_path, bad, message):
    """Bad input raises the dedicated errors (printed as one line by the CLI), before any training."""
    import train

    if bad.get("train_file") == "EMPTY":
        (tmp_path / "empty.txt").write_text("")
        bad = {"train_file": str(tmp_path / "empty.txt")}
    if bad.get("tokenizer") == "GAPPED":  # a local tokenizer whose last character's id is past its length
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        chars = sorted(set(Path(small_text).read_text()))
        vocab = {c: i for i, c in enumerate(chars[:-1])} | {chars[-1]: len(chars) + 9}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[]))).save_pretrained(
            tmp_path / "gapped")
        bad = {"tokenizer": str(tmp_path / "gapped")}
    bad = dict(bad)
    args = tiny_args(bad.pop("train_file", small_text), tmp_path / "out", **bad)
    with pytest.raises((TrainingInputError, DataError), match=message):
        train.main(args)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


BAD_FILES = {"binary.txt": b"To be, or\nnot\xff\xfe to be\n", "bad.jsonl": b'{"text": "a"}\n\n{"text": "b"\n',
             "bad.yaml": b"max_steps: 3\nlearning_rate: [1e-3\n", "a_directory": None,
             "broken.json": b'[{"text": "a"} {"text": "b"}]'}


@pytest.mark.parametrize("bad, message", [
    (["--train_file", "binary.txt"], r"training file '.*binary.txt' is not UTF-8 text: byte 0xff at offset 13 "
                                     r"\(invalid start byte\); pass a text file, or convert it"),
    (["--train_file", "bad.jsonl"], r"training file '.*bad.jsonl', line 3: not valid JSON \(Expecting ',' delimiter, "
                                    r"column 13\); every line of a JSON lines file is one JSON object"),
    (["--config", "bad.yaml"], r"--config '.*bad.yaml': not valid YAML \(while parsing a flow sequence .* line 2, "),
    (["--learning_rate", "-1e-3"], r"--learning_rate must be >= 0, got -0.001: pass the peak learning rate as a "
                                   r"positive number"),
    (["--batch_size", "0"], r"--batch_size must be a positive integer, got 0"),
    (["--gradient_accumulation_steps", "0"], r"--gradient_accumulation_steps must be a positive integer, got 0"),
    (["--mixed_precision", "fp8x"], r"argument --mixed_precision/--mixed-precision: invalid choice: 'fp8x' \(choose "
                                    r"from 'no', 'bf16', 'fp16'\)"),
    (["--train_file", "a_directory"], r"training file '.*a_directory' is a folder without data files; it must hold "
                                      r"files ending in .txt, "),
    (["--train_file", "broken.json"], r"training file '.*broken.json': not valid JSON \(Expecting ',' delimiter, line 1 "
                                      r"column 16\); a .json file is one JSON document"),
])
def test_bad_input_is_one_line_naming_the_problem_and_the_fix(small_text, tmp_path, capsys, bad, message):
    import train

    for name, content in BAD_FILES.items():
        (tmp_path / name).mkdir() if content is None else (tmp_path / name).write_bytes(content)
    bad = [str(tmp_path / arg) if arg in BAD_FILES else arg for arg in bad]
    assert train.cli(tiny_args(small_text, tmp_path / "out") + bad) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(f"error: {message}.*\n", err), err


def test_learning_rate_0_warns_and_trains(small_text, tmp_path, caplog):
    import train

    final = train.main(tiny_args(small_text, tmp_path / "out", learning_rate=0, max_steps=1, eval_interval=0,
                                 save_interval=0, sample_tokens=0))
    assert final["step"] == 1
    assert "--learning_rate 0: the weights will not change (training runs anyway)" in caplog.text


def test_without_data_flags_train_py_trains_on_the_shipped_text(tmp_path, capsys, monkeypatch):
    """No --dataset or --train_file (the presets name no local file): train.py trains, offline, on the Tiny
    Shakespeare text shipped with the package, its last 10% held out (nanoGPT's split)."""
    import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    final = train.main(tiny_args(None, tmp_path / "out", max_steps=2, eval_interval=2, eval_iters=2, save_interval=0,
                                 sample_tokens=0))
    assert final["step"] == 2
    text = SHAKESPEARE.read_text()
    cut = int(len(text) * 0.9)  # one token per character (the preset's char tokenizer)
    assert f"vocab 65, {cut // 32} train / {(len(text) - cut) // 32} val blocks of 32" in capsys.readouterr().out


@pytest.mark.parametrize("flag, runs_in, source", [
    ([], "bf16", "the launcher's: accelerate launch --mixed_precision or its config file"),
    (["--config", PRESET], "bf16", "the launcher's: accelerate launch --mixed_precision or its config file, over the "
                                   "preset's no"),
    (["--mixed_precision", "no"], "no", "train.py --mixed_precision"),
], ids=["no-preset", "over-the-preset", "command-line"])
def test_mixed_precision_is_the_launchers_unless_train_py_is_given_one(small_text, tmp_path, capsys, monkeypatch,
                                                                       flag, runs_in, source):
    """`accelerate launch --mixed_precision bf16` (or its config file) sets ACCELERATE_MIXED_PRECISION: with no
    --mixed_precision of its own train.py runs in it, over a preset's (shakespeare-char's "no" used to win), and says
    which one applied; train.py's own wins."""
    import train
    from accelerate.state import AcceleratorState

    from bilinear_lm.training import distributed

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(distributed, "cpu_has_native_bf16", lambda: False)
    args = ["--train_file", small_text, "--tokenizer", "char", "--output_dir", str(tmp_path), "--max_steps", "1",
            "--block_size", "16", "--batch_size", "2", "--eval_interval", "0", "--save_interval", "0",
            "--sample_tokens", "0", *(f"--model.{k}={v}" for k, v in TINY_MODEL.items()), *flag]
    AcceleratorState._reset_state(reset_partial_state=True)  # the in-process runs before this one set it to no
    try:
        train.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    out = capsys.readouterr().out
    assert f"tokens per optimizer step), mixed precision {runs_in} ({source})\n" in out
    assert ("--mixed_precision bf16 on a CPU without native bf16" in out) == (runs_in == "bf16")


def test_eval_lm_harness_flag_calls_run_lm_eval(small_text, tmp_path, monkeypatch):
    lm_harness = pytest.importorskip("bilinear_lm.evaluation.harness")
    import train

    from transformers import AutoTokenizer

    calls = []

    def fake_run_lm_eval(model, tokenizer, tasks, limit=None, **kwargs):
        """The real one's contract: a tokenizer with EOS; returns {task: {metric: value}}."""
        assert tokenizer.eos_token_id is not None
        calls.append((type(model).__name__, len(tokenizer), tasks, limit))
        return {t: {"acc": 0.5, "acc_stderr": "N/A"} for t in tasks}

    monkeypatch.setattr(lm_harness, "run_lm_eval", fake_run_lm_eval)
    out = tmp_path / "out"
    train.main(tiny_args(small_text, out, max_steps=2, save_interval=0, eval_interval=0, sample_tokens=0,
                         tokenizer="bpe", bpe_vocab_size=300,  # lm-eval needs an EOS token: the char one has none
                         eval_lm_harness="lambada_openai,arc_easy", lm_harness_limit=3))
    assert calls == [("BilinearForCausalLM", len(AutoTokenizer.from_pretrained(out)), ["lambada_openai", "arc_easy"], 3)]
    assert json.loads((out / "lm_harness.json").read_text()) == {
        t: {"acc": 0.5, "acc_stderr": "N/A"} for t in ("lambada_openai", "arc_easy")}


# ---------------------------------------------------------------- checkpoints you can trust (issue 23 item 4)
CKPT_STEPS = 8  # checkpoints at 2, 4, 6, 8


def ckpt_args(small_text, out, **overrides):
    return tiny_args(small_text, out, **{"max_steps": CKPT_STEPS, "save_interval": 2, "save_total_limit": 0,
                                         "eval_interval": 0, "sample_tokens": 0, **overrides})


@pytest.fixture(scope="module")
def saved_run(small_text, tmp_path_factory):
    """A tiny run that saved every 2 steps and kept all 4 checkpoints (tests resume copies of it)."""
    import train

    out = tmp_path_factory.mktemp("ckpt") / "run"
    train.main(ckpt_args(small_text, out))
    return out


def _copy_run(saved_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


def _damage(path, how):
    if how == "flip":  # one bit inside the tensor data, size unchanged
        data = bytearray(path.read_bytes())
        data[len(data) - 7] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_checkpoints_carry_their_config_and_a_manifest_of_every_file(saved_run):
    from bilinear_lm.training import verify_checkpoint

    ckpt = saved_run / "checkpoints" / f"step_{CKPT_STEPS}"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {"manifest.json", "CHECKPOINT_COMPLETE"}
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "trainer_state.json", "training_config.json",
            "tokenizer/tokenizer.json"} <= set(manifest)
    assert not any(name.startswith("custom_checkpoint") for name in manifest)  # nothing loaded with weights_only=False
    saved = json.loads((ckpt / "training_config.json").read_text())
    assert saved["train"]["batch_size"] == 4 and saved["data"]["block_size"] == 32
    assert saved["model"]["hidden_size"] == 32
    assert verify_checkpoint(ckpt) is None


@pytest.mark.parametrize("file, how, reason", [
    ("model.safetensors", "flip", "model.safetensors does not match its SHA-256 in the manifest (corrupted)"),
    ("optimizer.bin", "truncate", "optimizer.bin has"),
])
def test_latest_falls_back_past_a_damaged_checkpoint_and_the_run_continues(saved_run, small_text, tmp_path, capsys,
                                                                            file, how, reason):
    import train

    out = _copy_run(saved_run, tmp_path)
    bad = out / "checkpoints" / f"step_{CKPT_STEPS}"
    _damage(bad / file, how)
    before = losses(read_metrics(saved_run / "metrics.jsonl"))
    final = train.main(ckpt_args(small_text, out,
                                 resume_from_checkpoint="latest"))
    stdout = capsys.readouterr().out
    assert f"warning: skipping checkpoint {bad}: {reason}" in stdout
    assert f"resumed from {out / 'checkpoints' / f'step_{CKPT_STEPS - 2}'} at step {CKPT_STEPS - 2}" in stdout
    assert final["step"] == CKPT_STEPS
    # steps 7 and 8 were trained again from step 6, exactly as the first time; step 8 was saved afresh and is valid
    assert losses(read_metrics(out / "metrics.jsonl")) == before
    from bilinear_lm.training import verify_checkpoint

    assert verify_checkpoint(bad) is None


def test_an_explicitly_named_damaged_checkpoint_is_a_one_line_error(saved_run, small_text, tmp_path, capsys):
    import train

    out = _copy_run(saved_run, tmp_path)
    bad = out / "checkpoints" / "step_4"
    _damage(bad / "model.safetensors", "truncate")
    assert train.cli(ckpt_args(small_text, out, resume_from_checkpoint=str(bad))) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --resume_from_checkpoint '{bad}': the checkpoint is "
                                                    f"damaged: model.safetensors has ")
    assert "Traceback" not in err


def test_resuming_with_another_model_option_is_an_error_naming_it(saved_run, small_text, tmp_path):
    import train

    out = _copy_run(saved_run, tmp_path)
    with pytest.raises(TrainingInputError, match=r"the model differs from the checkpoint's "
                                                 r"\(--model.hidden_size 32 -> 48\)") as err:
        train.main(ckpt_args(small_text, out, resume_from_checkpoint="latest", **{"model.hidden_size": 48}))
    assert "\n" not in str(err.value)
    with pytest.raises(TrainingInputError, match=r"--model.hidden_size 32 -> 48"):  # --allow_config_change or not
        train.main(ckpt_args(small_text, out, resume_from_checkpoint="latest", allow_config_change="true",
                             **{"model.hidden_size": 48}))


def test_resuming_with_another_batch_size_needs_allow_config_change(saved_run, small_text, tmp_path, capsys):
    import train

    out = _copy_run(saved_run, tmp_path)
    with pytest.raises(TrainingInputError, match=r"the data or optimization differs from the checkpoint's "
                                                 r"\(--batch_size 4 -> 2\).*pass --allow_config_change"):
        train.main(ckpt_args(small_text, out, resume_from_checkpoint="latest", batch_size=2))
    capsys.readouterr()
    # options that may change do not need the flag: max_steps (the run goes on), logging and saving intervals
    final = train.main(ckpt_args(small_text, out, resume_from_checkpoint="latest", batch_size=2,
                                 allow_config_change="true", max_steps=CKPT_STEPS + 2, log_interval=2))
    stdout = capsys.readouterr().out
    assert "--batch_size 4 -> 2; --allow_config_change" in stdout and f"at step {CKPT_STEPS}" in stdout
    assert final["step"] == CKPT_STEPS + 2
    saved = json.loads((out / "checkpoints" / f"step_{CKPT_STEPS + 2}" / "training_config.json").read_text())
    assert saved["train"]["batch_size"] == 2  # the next resume compares with the options it ran with


def test_resume_unpickles_only_with_weights_only(saved_run, small_text, tmp_path, monkeypatch):
    """Every torch.load of a resume (Accelerate's, of optimizer.bin, scheduler.bin, the RNG states) is weights_only;
    the rest of a checkpoint is JSON and safetensors."""
    import train

    out = _copy_run(saved_run, tmp_path)
    calls, real_load = [], torch.load

    def recording_load(f, *args, **kwargs):
        calls.append((Path(str(f)).name, kwargs.get("weights_only")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    assert train.main(ckpt_args(small_text, out, resume_from_checkpoint="latest"))["step"] == CKPT_STEPS
    assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= {name for name, _ in calls}
    assert all(weights_only is True for _, weights_only in calls), calls


def test_save_total_limit_keeps_the_newest_checkpoints(small_text, tmp_path):
    import train

    out = tmp_path / "run"
    train.main(ckpt_args(small_text, out, save_total_limit=2))  # 4 saves
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{CKPT_STEPS - 2}", f"step_{CKPT_STEPS}"]


# -------------------------------------------------- subprocess runs (started at module start, checked last)
def test_end_to_end_checkpoint_metrics_plot_and_sample(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stdout = runs.finish(runs.a)
    out = runs.a_dir
    records = read_metrics(out / "metrics.jsonl")
    train_losses = losses(records)
    assert sorted(train_losses) == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(v) for v in train_losses.values())
    text = SHAKESPEARE.read_text()[:40_000]
    vocab = len(set(text))
    val = losses(records, "val_loss")
    assert sorted(val) == list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
    assert val[MAX_STEPS] < val[EVAL_EVERY] < math.log(vocab)  # learning, and better than a uniform guess
    assert records[-1]["final"] and records[-1]["params_identical_across_ranks"]
    assert (out / "loss.png").stat().st_size > 1000
    assert "--- sample" in stdout
    assert "1 process (NO), global batch 4 sequences = batch_size 4 x 1 processes x 1 accumulation steps" in stdout
    seconds = [r["train_seconds"] for r in records if "loss" in r]
    assert all(0 < a < b for a, b in zip(seconds, seconds[1:]))
    assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    # feedback: the process's peak memory in every evaluation record, a closing summary line, a model card
    evals = [r for r in records if "val_loss" in r]
    assert all(r["peak_rss_mib"] > 100 for r in evals + [records[-1]])
    last_line = stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"done: {MAX_STEPS} steps in \S+ \(\S+ training, [\d,]+ tokens/s\), train loss "
                        rf"{train_losses[MAX_STEPS]:.4f}, val loss {val[MAX_STEPS]:.4f} \(ppl [\d.]+, step {MAX_STEPS}\), "
                        rf"peak memory [\d.]+ GiB RSS; model in {out}, checkpoints in {out / 'checkpoints'} "
                        rf"\(newest step_{MAX_STEPS}\)", last_line), last_line
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-generation" and card.data.library_name == "transformers"
    assert f"| validation loss | {val[MAX_STEPS]:.4f} (step {MAX_STEPS}) |" in card.text
    assert f"| final training loss | {train_losses[MAX_STEPS]:.4f} (step {MAX_STEPS}) |" in card.text
    assert f"train.py {' '.join(tiny_args(runs.small_text, out))}" in card.text

    # the saved model + tokenizer reproduce the logged final validation loss through a second code path
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "bilinear" and len(tok) == model.config.vocab_size == vocab
    ids = torch.tensor(tok(text[36_000:], add_special_tokens=False)["input_ids"])  # the last 10% = validation
    blocks = ids[: len(ids) // 32 * 32].view(-1, 32)
    with torch.no_grad():
        batch_losses = [model(input_ids=b, labels=b).loss for b in blocks.split(4)]
    assert torch.stack(batch_losses).mean().item() == pytest.approx(val[MAX_STEPS], abs=1e-4)


def test_sigkill_then_resume_reproduces_losses_exactly(runs):
    runs.finish(runs.a)
    runs.watcher.join(timeout=400)
    stdout = runs.finish(runs.resumed)
    assert not any(r.get("final") for r in runs.killed_records), "run B finished before it could be killed"
    ckpts = sorted(int(p.name.split("_")[1]) for p in (runs.b_dir / "checkpoints").glob("step_*"))
    assert ckpts[0] == SAVE_EVERY
    assert "resumed from" in stdout
    a, b = read_metrics(runs.a_dir / "metrics.jsonl"), read_metrics(runs.b_dir / "metrics.jsonl")
    # the training clock is saved with the checkpoint: the resumed run's train_seconds continue from it
    saved = json.loads((runs.b_dir / "checkpoints" / f"step_{SAVE_EVERY}" / "trainer_state.json").read_text())
    assert saved["step"] == SAVE_EVERY and saved["train_seconds"] > 0
    seconds = {r["step"]: r["train_seconds"] for r in b if "loss" in r}
    assert seconds[SAVE_EVERY] <= saved["train_seconds"] < seconds[SAVE_EVERY + 1]
    assert all(seconds[k] < seconds[k + 1] for k in range(1, MAX_STEPS))
    assert losses(b) == losses(a)  # bitwise, every step, fp32 and same seed
    assert losses(b, "val_loss") == losses(a, "val_loss")
    from safetensors.torch import load_file

    wa, wb = load_file(runs.a_dir / "model.safetensors"), load_file(runs.b_dir / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_rank_cpu_ddp(runs):
    stdout = runs.finish(runs.ddp)
    records = read_metrics(runs.ddp_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in steps)
    # each rank got its own shard of the global batch: at every step, 4 blocks per rank and none on both ranks
    rank0, rank1 = (read_metrics(runs.batch_log / f"rank{i}.jsonl") for i in (0, 1))
    assert [r["step"] for r in rank0] == [r["step"] for r in rank1] == [1, 2, 3, 4]
    for a, b in zip(rank0, rank1):
        blocks_a, blocks_b = {tuple(row) for row in a["input_ids"]}, {tuple(row) for row in b["input_ids"]}
        assert len(blocks_a) == len(blocks_b) == 4 and not blocks_a & blocks_b
    assert "2 processes (MULTI_CPU), global batch 8 sequences = batch_size 4 x 2 processes" in stdout
    final = records[-1]
    assert final["num_processes"] == 2 and final["params_identical_across_ranks"] is True
    # the DDP model is freed before the process group is destroyed, on every rank (bilinear_lm.training.end_training)
    assert [json.loads((runs.batch_log / f"teardown{i}.json").read_text()) for i in (0, 1)] == \
        [{"ddp_models_alive": 0}] * 2
    assert {p.name for p in (runs.ddp_dir / "checkpoints" / "step_4").iterdir()} >= {
        "random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "manifest.json", "training_config.json",
        "CHECKPOINT_COMPLETE"}


def test_two_rank_cpu_ddp_fails_on_every_rank_when_the_main_one_fails(runs):
    """The main process fails while building the tokenizer: the other rank learns it from a shared flag and stops
    with its own one-line error. (Before, it waited in a barrier: here gloo noticed the closed connection and it
    died with a RuntimeError traceback; where a barrier does not notice, e.g. NCCL, it waited forever.)"""
    out, _ = runs.ddp_fail.communicate(timeout=120)
    assert runs.ddp_fail.returncode != 0, out[-4000:]
    assert "error: tokenizer path '/nonexistent/dir' is not a directory" in out, out[-4000:]
    assert "error: building the tokenizer failed on process 0 (its error is printed above); stopping process 1 too" \
        in out, out[-4000:]
    assert "[rank1]: Traceback" not in out and "Connection closed by peer" not in out, out[-4000:]


def test_the_readmes_command_fails_with_one_line_under_accelerate_launch(runs):
    """The README's command on a bad input (a missing --train_file), run as it is written: train.py's one `error:`
    line is all its stderr (no launcher notice of defaults: the command's config file gives them), and the exit status
    is not 0. Without -q Accelerate's launcher re-raised the non-zero exit as a CalledProcessError traceback (12
    lines); without a config file it printed a six-line notice first."""
    assert runs.readme is not None, "the README's main command"
    _, stderr = runs.readme.communicate(timeout=300)
    assert runs.readme.returncode != 0
    assert not LAUNCHER_NOTICE.search(stderr), stderr
    assert stderr == f"error: training file '{runs.readme_missing}' does not exist (resolved to " \
                     f"{runs.readme_missing}); check the path\n", stderr


def test_a_diverged_run_stops_with_one_line_naming_the_last_good_checkpoint(small_text, tmp_path, capsys):
    """At lr 1e8 the loss is NaN within a few steps: train.py stops there (not after max_steps of NaN), saves no
    checkpoint and no model of the diverged weights, and names the last checkpoint to resume from."""
    import train
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert train.cli(tiny_args(small_text, out, learning_rate=1e8, max_steps=30, save_interval=2, log_interval=5,
                               eval_interval=0, sample_tokens=0)) == 1
    err = capsys.readouterr().err
    match = re.search(r"error: the (?:training loss|gradient norm) is (?:nan|inf) at step (\d+) \(learning rate "
                      r"1e\+08\): the run diverged and stops here; the last checkpoint, (.*step_(\d+)), is from before "
                      r"it: resume from it with --resume_from_checkpoint latest --allow_config_change and a lower "
                      r"--learning_rate \(or a smaller --grad_clip\)\n", err)  # after the progress bar (tqdm: stderr)
    assert match and err.count("error:") == 1 and "Traceback" not in err, err
    nan_step, checkpoint, saved_step = int(match[1]), match[2], int(match[3])
    assert saved_step < nan_step < 30
    assert all(torch.isfinite(t).all() for t in load_file(f"{checkpoint}/model.safetensors").values())
    assert not (out / "model.safetensors").exists()


def test_a_diverged_message_names_what_to_resume_from(tmp_path):
    """No checkpoint in the output folder: a run resumed from another folder's checkpoint is told to resume from it
    again; a fresh run (or one resumed from 'latest') to start again."""
    from types import SimpleNamespace

    from bilinear_lm.training import diverged_message

    def message(resume_from_checkpoint):
        cfg = SimpleNamespace(train=SimpleNamespace(output_dir=str(tmp_path), learning_rate=1e-3,
                                                    resume_from_checkpoint=resume_from_checkpoint))
        return diverged_message(cfg, 7, "the gradient norm is nan")

    assert message("other/checkpoints/step_90").endswith(
        "no checkpoint was saved since this run resumed from other/checkpoints/step_90: resume from it again with "
        "--allow_config_change and a lower --learning_rate (or a smaller --grad_clip)")
    assert message(None).endswith("no checkpoint was saved: start again with a lower --learning_rate (or a smaller "
                                  "--grad_clip)")
    assert message("latest") == message(None)


class _NanGradient(torch.autograd.Function):
    """The identity forward; NaN backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_a_nan_gradient_under_a_finite_loss_stops_before_the_update_and_before_a_save(small_text, tmp_path, capsys,
                                                                                    monkeypatch):
    """Step 3's loss is finite but its gradient NaN (the matrix-state Gutenberg run's divergence): train.py stops
    before that update, so the checkpoint of step 3 is never written from NaN weights and step 2's is named."""
    import train
    from safetensors.torch import load_file

    forward, calls = BilinearForCausalLM.forward, []

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training and out.loss is not None:
            calls.append(1)
            if len(calls) == 3:
                out.loss = _NanGradient.apply(out.loss)
        return out

    monkeypatch.setattr(BilinearForCausalLM, "forward", poisoned)
    out = tmp_path / "out"
    assert train.cli(tiny_args(small_text, out, max_steps=6, save_interval=1, log_interval=5, eval_interval=0,
                               sample_tokens=0)) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: the gradient norm is nan at step 3 \(learning rate 0\.003\): the run diverged and "
                     r"stops here; the last checkpoint, .*step_2, is from before it", err), err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert all(torch.isfinite(t).all() for t in load_file(out / "checkpoints/step_2/model.safetensors").values())


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_last_complete_checkpoint_resumes(small_text, tmp_path,
                                                                                         capsys, monkeypatch):
    """The second checkpoint's save writes its files, then fails as a full disk does (ENOSPC): train.py stops with
    one line (the folder, the sizes, the resume command), the partial folder is gone, the first checkpoint stays
    complete, and resuming from 'latest' after that finishes the run from it."""
    import accelerate

    import train

    save_state, calls = accelerate.Accelerator.save_state, []

    def fills_the_disk(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        save_state(self, output_dir, **kwargs)
        if len(calls) == 2:
            _no_space()

    monkeypatch.setattr(accelerate.Accelerator, "save_state", fills_the_disk)
    out = tmp_path / "out"
    args = tiny_args(small_text, out, max_steps=6, save_interval=2, log_interval=5, eval_interval=0, sample_tokens=0)
    assert train.cli(args) == 1
    err = capsys.readouterr().err
    first = out / "checkpoints" / "step_2"
    line = re.search(rf"error: no space left in {re.escape(str(out))} to save checkpoint step_4: a checkpoint takes "
                     rf"about [\d.]+ MB, [\d.]+ MB are free there; free some space, then run the same command with "
                     rf"--resume_from_checkpoint latest \(it continues from {re.escape(str(first))}\)\n", err)
    assert line and err.count("error:") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # .tmp_step_4 removed
    monkeypatch.setattr(accelerate.Accelerator, "save_state", save_state)
    assert train.main(args + ["--resume_from_checkpoint", "latest"])["step"] == 6
    assert f"resumed from {first} at step 2" in capsys.readouterr().out


def test_a_full_disk_at_the_final_save_is_one_line_naming_the_last_checkpoint(small_text, tmp_path, capsys,
                                                                             monkeypatch):
    from transformers import PreTrainedModel

    import train

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", _no_space)
    out = tmp_path / "out"
    assert train.cli(tiny_args(small_text, out, max_steps=4, save_interval=4, log_interval=5, eval_interval=0,
                               sample_tokens=0)) == 1
    err = capsys.readouterr().err
    assert re.search(rf"error: no space left in {re.escape(str(out))} to save the final model: .* run the same "
                     rf"command with --resume_from_checkpoint latest \(it continues from "
                     rf"{re.escape(str(out / 'checkpoints' / 'step_4'))}\)\n", err) and err.count("error:") == 1, err
