"""A run owns its --output_dir and stops gracefully (issue 37, items 1 and 2; docs/training.md, "The output folder").

- One live run per folder: a second one is refused with one line naming the first's PID (in-process, and under
  2-rank CPU DDP on every rank); the lock goes with the process that held it.
- Another run's results (checkpoints, metrics.jsonl, a final model) are never mixed with a new run's: it is refused,
  or `--overwrite_output_dir` deletes them first; `latest` with only damaged checkpoints is an error naming them.
- SIGTERM / SIGINT: a checkpoint at the end of the step, one line naming it, exit 143 / 130, no traceback; `latest`
  continues from it (exactly: the losses of an uninterrupted run); under DDP, SIGTERM to the launcher (which
  forwards it to its workers) stops both ranks at the same step.

The subprocesses (train.py runs that train until they are signalled) start together at module start; the tests of
the in-process runs come first, while they start, theirs last.
"""
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from bilinear_lm.training import TrainingInputError, parse_config, read_metrics, verify_checkpoint
from test_train import ENV, REPO, Runs, losses, small_text, tiny_args  # noqa: F401 - small_text: the module's fixture

HOST = socket.gethostname()
ACCELERATE_1_16 = Version(version("accelerate")) >= Version("1.16")  # its launchers exit 128 + signal
LOCK_FILE = ".train.lock"  # held by a live run's main process, and naming it
# runs that train until they are signalled: no evaluation, no periodic checkpoint, no sample; warmup longer than any
# of them, so that the learning rate of a step does not depend on max_steps (the reference run stops early)
UNTIL_SIGNALLED = {"max_steps": 100_000, "warmup_steps": 1000, "log_interval": 1, "eval_interval": 0,
                   "save_interval": 0, "sample_tokens": 0}
QUICK = {"eval_interval": 0, "sample_tokens": 0, "save_total_limit": 0}


ddp_launch, popen = Runs._ddp_launch, Runs._popen  # accelerate launch --multi_gpu --num_processes 2; output piped
# train.py (its cli: signals, exit status) with 50 ms of sleep before each micro-batch: the runs that wait for their
# signal leave the 2 cores to the others' start and to the in-process tests (and the signal mostly lands in a sleep)
THROTTLED_TRAIN = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import train
from bilinear_lm.training import micro_batches

def throttled(accelerator, train_dl, state):
    for batch in micro_batches(accelerator, train_dl, state):
        time.sleep(0.05)
        yield batch

train.micro_batches = throttled
sys.exit(train.cli())
"""


def wait_for_step(proc, out_dir: Path, step: int, timeout: float = 300) -> None:
    """Until `proc` has logged training step `step` (or more) to out_dir/metrics.jsonl."""
    deadline, path = time.time() + timeout, out_dir / "metrics.jsonl"
    while time.time() < deadline:
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines: one may be in writing
        if any(json.loads(line)["step"] >= step for line in lines):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout} s")


def stopped_line(output: str, name: str) -> re.Match:
    lines = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1, output[-3000:]
    match = re.fullmatch(rf"stopped by {name} at step (\d+): saved the checkpoint (.*); continue with "
                         rf"--resume_from_checkpoint latest", lines[0])
    assert match, lines
    return match


class Stopper(threading.Thread):
    """Sends `signum` to `proc` (`group`: to its process group, as a terminal's Ctrl-C does) once it has logged step
    `step` to out_dir/metrics.jsonl, then waits for it to end; `outcome()`: its output, its exit status and the
    seconds from the signal to its end."""

    def __init__(self, proc, out_dir: Path, step: int, signum: int, group: bool = False):
        super().__init__(daemon=True)
        self.proc, self.out_dir, self.step, self.signum, self.group = proc, out_dir, step, signum, group
        self.result, self.error = None, None
        self.start()

    def run(self):
        try:
            wait_for_step(self.proc, self.out_dir, self.step)
            signalled = time.time()
            if self.group:
                os.killpg(self.proc.pid, self.signum)
            else:
                self.proc.send_signal(self.signum)
            out, _ = self.proc.communicate(timeout=120)
            self.result = out, self.proc.returncode, time.time() - signalled
        except BaseException as error:  # noqa: BLE001 - pytest.fail's, or a timeout: raised in the test
            self.error = error

    def outcome(self) -> tuple[str, int, float]:
        self.join(timeout=400)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the run did not end within 400 s"
        return self.result


class Victims:
    """Started at module start (their tests come last): INT, a single-process run holding its folder until its test
    sends SIGINT; TERM, a single-process run with 2 accumulation steps per optimizer step, and DDP, a 2-rank CPU DDP
    run, sent SIGTERM (DDP: its launcher) at steps 2 and 1 by `Stopper` threads; LAUNCHED, a one-process
    `accelerate launch` in a session of its own, sent SIGINT to its process group at step 5 (all four
    THROTTLED_TRAIN); DDP_REFUSED: a 2-rank launch of train.py into a folder whose lock this test process holds, as a
    live run does (flock on .train.lock, which names it)."""

    def __init__(self, text, root: Path):
        self.text, self.root = text, root
        self.term_dir, self.int_dir, self.ddp_dir, self.locked_dir, self.launched_dir = (
            root / name for name in ("term", "int", "ddp", "locked", "launched"))
        self.term_args = dict(UNTIL_SIGNALLED, gradient_accumulation_steps=2)
        self.term_step = None  # where SIGTERM stopped TERM
        script = str(root / "throttled_train.py")
        Path(script).write_text(THROTTLED_TRAIN)
        self.term = popen([sys.executable, script, *tiny_args(text, self.term_dir, **self.term_args)])
        self.int = popen([sys.executable, script, *tiny_args(text, self.int_dir, **UNTIL_SIGNALLED)])
        ddp_env = {**ENV, "ACCELERATE_USE_CPU": "1"}
        self.ddp = popen(ddp_launch() + [script, *tiny_args(text, self.ddp_dir, **UNTIL_SIGNALLED)], env=ddp_env)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script,
                  *tiny_args(text, self.launched_dir, **UNTIL_SIGNALLED)]
        self.launched = subprocess.Popen(  # as from a terminal: a process group of its own, SIGINT not ignored
            [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, sys.argv[1:])", *launch], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.locked_dir.mkdir()
        self.lock = open(self.locked_dir / LOCK_FILE, "w")  # noqa: SIM115 - held until stop()
        fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.lock.write(f"{os.getpid()} {HOST}\n")
        self.lock.flush()
        self.ddp_refused = popen(ddp_launch() + ["train.py", *tiny_args(text, self.locked_dir, max_steps=2, **QUICK)],
                                 env=ddp_env)
        self.term_stopper = Stopper(self.term, self.term_dir, 2, signal.SIGTERM)
        self.ddp_stopper = Stopper(self.ddp, self.ddp_dir, 1, signal.SIGTERM)
        # at step 5, when the others have started: the launcher gives train.py 5 s to save
        self.launched_stopper = Stopper(self.launched, self.launched_dir, 5, signal.SIGINT, group=True)

    def stop(self):
        self.lock.close()
        for proc in (self.term, self.int, self.ddp, self.ddp_refused, self.launched):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the launched run's train.py, were its launcher killed
            os.killpg(self.launched.pid, signal.SIGKILL)


@pytest.fixture(scope="module", autouse=True)
def victims(small_text, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the in-process runs share the 2 cores with the subprocesses (and match their numerics)
    victims = Victims(small_text, tmp_path_factory.mktemp("victims"))
    yield victims
    victims.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished_run(small_text, tmp_path_factory):
    """A finished 4-step run: checkpoints at steps 2 and 4, metrics.jsonl, the final model."""
    import train

    out = tmp_path_factory.mktemp("finished") / "run"
    train.main(tiny_args(small_text, out, max_steps=4, save_interval=2, **QUICK))
    return out


def snapshot(out: Path) -> dict:
    """Every file under `out` (but the lock file) and its bytes."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


# ------------------------------------------------------------------------- another run's results are not mixed
def test_a_new_run_into_a_used_folder_is_refused_and_overwrite_starts_afresh(finished_run, small_text, tmp_path,
                                                                           capsys):
    """Before, the new run truncated metrics.jsonl, overwrote the final model and left its step_1 beside the old
    run's step_2 / step_4 (which `latest` would pick)."""
    import train

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = snapshot(out)
    args = tiny_args(small_text, out, max_steps=2, save_interval=1, **QUICK)
    assert train.cli(args) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --output_dir {out} holds another run's results (checkpoints/step_2, checkpoints/step_4, "
                   f"metrics.jsonl, model.safetensors): continue that run with --resume_from_checkpoint latest, pass "
                   f"--overwrite_output_dir to delete them and start afresh, or choose another --output_dir\n")
    assert snapshot(out) == before

    assert train.cli(args + ["--overwrite_output_dir"]) == 0
    assert f"--overwrite_output_dir: deleted the previous run's results in {out}: checkpoints, config.json, " \
           f"generation_config.json, loss.png, metrics.jsonl, model.safetensors, tokenizer\n" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]  # no stale step_4
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 2] and records[-1]["final"]  # this run's only
    assert snapshot(out)["model.safetensors"] != before["model.safetensors"]


@pytest.mark.parametrize("case", ["metrics only, latest", "final model only", "resumed from another folder"])
def test_runs_that_do_not_continue_the_folders_run_are_refused(finished_run, small_text, tmp_path, capsys, case):
    """Refused before anything is read or written: `latest` with nothing to resume (but results) starts afresh, and
    so does a run resumed from another folder's checkpoint: both would mix with what is there."""
    import train

    out = tmp_path / "out"
    out.mkdir()
    if case == "metrics only, latest":  # a run killed before its first checkpoint
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
        extra, message = ["--resume_from_checkpoint", "latest"], (
            rf"holds another run's results \(metrics.jsonl\) but no checkpoint to resume from "
            rf"\(--resume_from_checkpoint latest\): pass --overwrite_output_dir to delete them and start afresh, or "
            rf"choose another --output_dir")
    elif case == "final model only":  # a run with --save_interval 0
        (out / "model.safetensors").write_bytes(b"weights")
        extra, message = [], r"holds another run's results \(model.safetensors\): continue that run with"
    else:
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
        ckpt = finished_run / "checkpoints" / "step_2"
        extra, message = ["--resume_from_checkpoint", str(ckpt)], (
            rf"holds another run's results \(metrics.jsonl\), which a run resumed from {ckpt} \(another folder's "
            rf"checkpoint\) must not mix with: choose another --output_dir, or pass --overwrite_output_dir")
    before = snapshot(out)
    assert train.cli(tiny_args(small_text, out, max_steps=4, **QUICK) + extra) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(rf"error: --output_dir {out} {message}.*\n", err), err
    assert snapshot(out) == before


def test_latest_with_every_checkpoint_damaged_is_an_error_naming_them(finished_run, small_text, tmp_path, capsys):
    """Before, it warned about each, trained from scratch and overwrote and pruned the damaged checkpoints."""
    import train

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    for step in (2, 4):
        weights = out / "checkpoints" / f"step_{step}" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    before = snapshot(out)
    args = tiny_args(small_text, out, max_steps=4, save_interval=2, **QUICK) + ["--resume_from_checkpoint", "latest"]
    assert train.cli(args) == 1
    captured = capsys.readouterr()
    size = (finished_run / "checkpoints" / "step_2" / "model.safetensors").stat().st_size
    assert captured.err == (
        f"error: --resume_from_checkpoint latest: no usable checkpoint in {out / 'checkpoints'}, every one is damaged "
        f"(step_4: model.safetensors has 100 bytes, the manifest says {size} (truncated or overwritten); step_2: "
        f"model.safetensors has 100 bytes, the manifest says {size} (truncated or overwritten)): resume from a good "
        f"copy with --resume_from_checkpoint PATH, or pass --overwrite_output_dir to delete them and start afresh\n")
    assert "warning" not in captured.out
    assert snapshot(out) == before
    # with --overwrite_output_dir: nothing to continue, so the damaged ones go with the other results
    assert train.cli(args + ["--overwrite_output_dir"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert all(verify_checkpoint(p) is None for p in (out / "checkpoints").iterdir())
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 4]


def test_latest_into_an_empty_or_missing_folder_starts_afresh(small_text, tmp_path, capsys):
    import train

    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "missing"):
        assert train.main(tiny_args(small_text, out, max_steps=1, save_interval=0, **QUICK)
                          + ["--resume_from_checkpoint", "latest"])["step"] == 1
        assert f"no complete checkpoint in {out / 'checkpoints'}: starting from scratch" in capsys.readouterr().out


def test_an_output_dir_that_cannot_be_created_is_a_one_line_error(small_text, tmp_path, capsys):
    import train

    (tmp_path / "a_file").write_text("")
    assert train.cli(tiny_args(small_text, tmp_path / "a_file" / "out", max_steps=1, **QUICK)) == 1
    assert capsys.readouterr().err == (f"error: --output_dir {tmp_path / 'a_file' / 'out'}: cannot write there (Not a "
                                       f"directory: {tmp_path / 'a_file' / 'out'})\n")


def test_without_flock_the_run_goes_on_unlocked_with_a_warning(tmp_path, monkeypatch):
    import errno

    from bilinear_lm.training.output_dir import OutputDirLock

    def no_flock(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    warnings = []
    OutputDirLock(tmp_path, warnings.append).release()
    assert warnings == [f"warning: cannot lock {tmp_path / LOCK_FILE} (No locks available): this filesystem has no "
                        f"flock, so another run started into --output_dir {tmp_path} while this one runs would not be "
                        f"refused"]


def test_overwrite_is_a_flag_of_the_training_config():
    assert parse_config([]).train.overwrite_output_dir is False
    assert parse_config(["--overwrite_output_dir"]).train.overwrite_output_dir is True


# ------------------------------------------------------------------------------ the lock goes with its holder
def test_the_lock_is_released_with_its_holder(tmp_path):
    from bilinear_lm.training.output_dir import OutputDirLock

    first = OutputDirLock(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()} {HOST}\n"
    with pytest.raises(TrainingInputError, match=rf"in use by another run \(PID {os.getpid()} on "):
        OutputDirLock(tmp_path)  # flock: two open files of one process exclude each other too
    first.release()
    OutputDirLock(tmp_path).release()
    # a holder that dies (SIGKILL: no clean-up) releases it: the kernel drops the flock with the process
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)",
                               str(tmp_path / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(TrainingInputError, match="in use by another run"):
        OutputDirLock(tmp_path)
    holder.kill()
    holder.wait()
    OutputDirLock(tmp_path).release()


# ----------------------------------------------------------------------------------------- StopOnSignal
class FakeRanks:
    """Two ranks' flags as `accelerator.gather` would give them to each."""

    num_processes, device, is_main_process = 2, torch.device("cpu"), True

    def __init__(self, other: int):
        self.other = other

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor([self.other])])


def test_every_rank_stops_for_the_signal_any_rank_got():
    from bilinear_lm.training import StopOnSignal

    with StopOnSignal() as stop:
        assert stop.requested(FakeRanks(other=0)) == 0
        assert stop.requested(FakeRanks(other=signal.SIGTERM)) == signal.SIGTERM  # this rank got none
        stop.defer()
        signal.raise_signal(signal.SIGINT)  # a real signal, handled: a flag
        assert stop.signum == signal.SIGINT and stop.requested(FakeRanks(other=0)) == signal.SIGINT
        assert stop.requested(FakeRanks(other=signal.SIGTERM)) == signal.SIGTERM  # the same on both ranks: the max


def test_signals_outside_the_steps_stop_at_once_and_handlers_are_restored():
    from bilinear_lm.training import StopOnSignal, Stopped

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match=r"stopped by SIGTERM outside the training steps") as stopped:
        with StopOnSignal():
            signal.raise_signal(signal.SIGTERM)
    assert stopped.value.exit_code == 143 and signal.getsignal(signal.SIGTERM) is previous
    with pytest.raises(Stopped, match="after the last training step") as stopped:  # came after the last check
        with StopOnSignal() as stop:
            stop.defer()
            signal.raise_signal(signal.SIGINT)
            stop.undefer()
    assert stopped.value.exit_code == 130


@pytest.mark.parametrize("first, second, at_once", [(signal.SIGTERM, signal.SIGTERM, False),
                                                   (signal.SIGINT, signal.SIGINT, True),
                                                   (signal.SIGTERM, signal.SIGINT, True),
                                                   (signal.SIGINT, signal.SIGTERM, False)])
def test_a_second_sigint_stops_at_once_a_second_sigterm_is_the_same_request(monkeypatch, first, second, at_once):
    """Ctrl-C while a stop is pending: the default action (the process ends, no traceback). A SIGTERM then is one
    request from several senders (Slurm signals every process of a step, torchrun forwards its own, and accelerate
    1.16's one-process launcher answers the Ctrl-C that train.py got too with a SIGTERM: that one had ended the run
    at once, before its checkpoint)."""
    from bilinear_lm.training import StopOnSignal

    raised = []
    with StopOnSignal() as stop:
        stop.defer()
        stop._handle(first, None)
        monkeypatch.setattr(signal, "raise_signal", raised.append)
        stop._handle(second, None)
        assert stop.signum == first and raised == ([second] if at_once else [])
        assert (signal.getsignal(second) is signal.SIG_DFL) == at_once


# ------------------------------------------------------------------------- one live run per folder (victims)
def test_a_second_run_into_a_live_runs_folder_is_refused_naming_its_pid(victims, small_text, capsys):
    """Two runs at once into one folder used to both "succeed", their metrics interleaved and their checkpoints
    overwriting each other's."""
    import train

    wait_for_step(victims.int, victims.int_dir, 1)
    before = (victims.int_dir / "metrics.jsonl").read_text()
    assert train.cli(tiny_args(small_text, victims.int_dir, max_steps=1, **QUICK)) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --output_dir {victims.int_dir} is in use by another run (PID {victims.int.pid} on "
                   f"{HOST}, which holds {victims.int_dir / LOCK_FILE}): wait for it to end or stop it, or choose "
                   f"another --output_dir\n")
    assert (victims.int_dir / "metrics.jsonl").read_text().startswith(before)  # not truncated: the first run goes on
    assert victims.int.poll() is None and not (victims.int_dir / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------- signals (victims)
def test_sigterm_saves_a_checkpoint_at_the_step_boundary(victims):
    """Before, SIGTERM ended the run with exit 143, no output and nothing saved since the last checkpoint."""
    out, status, _ = victims.term_stopper.outcome()
    assert status == 143, out[-3000:]
    match = stopped_line(out, "SIGTERM")
    step, checkpoint = int(match[1]), Path(match[2])
    assert checkpoint == victims.term_dir / "checkpoints" / f"step_{step}" and verify_checkpoint(checkpoint) is None
    assert sorted(p.name for p in (victims.term_dir / "checkpoints").iterdir()) == [f"step_{step}"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert "Traceback" not in out and not (victims.term_dir / "model.safetensors").exists()
    stopped_metrics = read_metrics(victims.term_dir / "metrics.jsonl")
    assert [r["step"] for r in stopped_metrics] == list(range(1, step + 1))
    victims.term_step = step


def test_sigint_saves_a_checkpoint_without_a_traceback_and_latest_continues(victims, small_text, capsys):
    """Before, Ctrl-C printed a KeyboardInterrupt traceback and saved nothing."""
    import train

    wait_for_step(victims.int, victims.int_dir, 1)
    victims.int.send_signal(signal.SIGINT)
    out, _ = victims.int.communicate(timeout=120)
    assert victims.int.returncode == 130, out[-3000:]
    step = int(stopped_line(out, "SIGINT")[1])
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert verify_checkpoint(victims.int_dir / "checkpoints" / f"step_{step}") is None
    final = train.main(tiny_args(small_text, victims.int_dir, **dict(UNTIL_SIGNALLED, max_steps=step + 1))
                       + ["--resume_from_checkpoint", "latest"])
    assert final["step"] == step + 1
    assert f"resumed from {victims.int_dir / 'checkpoints' / f'step_{step}'} at step {step}" in capsys.readouterr().out


def test_two_rank_ddp_sigterm_to_the_launcher_stops_both_ranks_at_one_step(victims):
    """`accelerate launch --multi_gpu` (torchrun) forwards the SIGTERM it gets to its workers (each in its own
    session), waits for them up to 30 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), then exits 143 (accelerate >= 1.16; before,
    1 with its own SignalException traceback). Both ranks save one checkpoint at the same step (a rank that stopped
    alone would leave the other waiting in a collective) and the main one prints the line."""
    out, status, seconds = victims.ddp_stopper.outcome()
    assert seconds < 30, out[-3000:]  # before the launcher's SIGKILL
    if ACCELERATE_1_16:  # the launcher exits as the signal would have, without a traceback
        assert status == 143 and "SignalException" not in out, out[-3000:]
    else:
        assert status == 1, out[-3000:]
        assert "torch.distributed.elastic.multiprocessing.api.SignalException" in out
    match = stopped_line(out, "SIGTERM")
    step, checkpoint = int(match[1]), Path(match[2])
    assert verify_checkpoint(checkpoint) is None
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert read_metrics(victims.ddp_dir / "metrics.jsonl")[-1]["step"] == step
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]


def test_ctrl_c_on_a_one_process_accelerate_launch_saves_a_checkpoint(victims):
    """A terminal's Ctrl-C signals the process group, train.py and the launcher. accelerate 1.16's launcher answers
    it by sending train.py SIGTERM (and SIGKILL 5 s later); train.py, already stopping for the SIGINT, took that for
    a second signal and ended at once, without its checkpoint (the README's command lost the run). Now the SIGTERM is
    the same request: train.py saves at the step's end and the launcher exits 130."""
    out, status, _ = victims.launched_stopper.outcome()
    match = stopped_line(out, "SIGINT")
    step, checkpoint = int(match[1]), Path(match[2])
    assert checkpoint == victims.launched_dir / "checkpoints" / f"step_{step}" and verify_checkpoint(checkpoint) is None
    assert read_metrics(victims.launched_dir / "metrics.jsonl")[-1]["step"] == step
    if ACCELERATE_1_16:
        assert status == 130 and "Traceback" not in out, out[-3000:]


def test_two_rank_ddp_into_a_locked_folder_is_refused_on_every_rank_without_hanging(victims):
    out, _ = victims.ddp_refused.communicate(timeout=300)
    assert victims.ddp_refused.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert sorted(errors) == sorted([  # the main process's reason, and the other rank's
        f"error: --output_dir {victims.locked_dir} is in use by another run (PID {os.getpid()} on {HOST}, which "
        f"holds {victims.locked_dir / LOCK_FILE}): wait for it to end or stop it, or choose another --output_dir",
        f"error: claiming --output_dir {victims.locked_dir} failed on process 0 (its error is printed above); "
        f"stopping process 1 too"]), out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    assert sorted(p.name for p in victims.locked_dir.iterdir()) == [LOCK_FILE]


def test_latest_continues_a_sigterm_checkpoint_as_if_uninterrupted(victims, small_text, tmp_path):
    """The checkpoint of a SIGTERM (at step N, 2 micro-batches per optimizer step) resumed to N + 2: the losses of
    every step are those of a run that was never stopped."""
    import train

    step = victims.term_step
    assert step, "SIGTERM did not stop the run (test_sigterm_saves_a_checkpoint_at_the_step_boundary)"
    args = dict(victims.term_args, max_steps=step + 2)
    final = train.main(tiny_args(small_text, victims.term_dir, **args) + ["--resume_from_checkpoint", "latest"])
    assert final["step"] == step + 2
    train.main(tiny_args(small_text, tmp_path / "uninterrupted", **args))
    resumed = losses(read_metrics(victims.term_dir / "metrics.jsonl"))
    assert sorted(resumed) == list(range(1, step + 3))
    assert resumed == pytest.approx(losses(read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")), abs=1e-5)
