"""A run owns its `--output_dir`: one live run at a time (a lock), and never another run's results mixed with its own.

    with own_output_dir(accelerator, cfg, warn=accelerator.print) as resume:   # the checkpoint to continue, or None
        ...train...

- **The lock.** The main process holds `fcntl.flock` on OUTPUT_DIR/.train.lock (holding its PID and host) from the
  start to the end of the run; the kernel releases it when the process ends, however it ends (SIGKILL included), so
  a lock is never stale. A second run into the folder while the first lives is a one-line error naming its PID.
- **Another run's results** (checkpoints, metrics.jsonl, a final model): a run that does not continue this folder's
  own run (it starts afresh, `--resume_from_checkpoint latest` found no checkpoint, or it resumes another folder's
  checkpoint) is refused while they are there, unless `--overwrite_output_dir`, which deletes them first (and only
  them: the files train.py writes, `RESULTS` + `ALSO_OVERWRITTEN`; anything else in the folder is left alone).
- **`latest` with only damaged checkpoints** is an error naming each and what is wrong with it (before, the run
  started from scratch and pruned them); with `--overwrite_output_dir` they are deleted and the run starts afresh.
  An empty or missing folder starts afresh.

Every rank takes part (the main process first: the lock and the rules; the others then find the same checkpoint):
if anything fails on one, it fails on all, and the lock is released.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable

from .checkpoint import check_config_change, find_checkpoint, latest_checkpoint
from .config import Config, TrainingInputError
from .distributed import together

LOCK_FILE = ".train.lock"
# what makes a folder hold a run's results: `--overwrite_output_dir` or a resume is needed to write into it
RESULTS = ("checkpoints/*", "metrics.jsonl", "model.safetensors", "model-*-of-*.safetensors",
           "model.safetensors.index.json")
# deleted with them by --overwrite_output_dir: the rest of what a run writes that would describe the old run (the
# final model's remaining files, e.g. its code and tokenizer files, are replaced by the new run's when it finishes)
ALSO_OVERWRITTEN = ("checkpoints", "loss.png", "lm_harness.json", "config.json", "generation_config.json", "tokenizer")


class OutputDirLock:
    """`fcntl.flock` on OUTPUT_DIR/.train.lock, taken without waiting: a held lock is a one-line TrainingInputError
    naming the holder, and so is a folder that cannot be written. On a filesystem without flock (some network
    filesystems' mounts) it `warn`s and the run goes on unlocked. The file is never deleted (deleting a flock file
    races with its next user)."""

    def __init__(self, out_dir: Path, warn: Callable[[str], None] = print):
        self.path = out_dir / LOCK_FILE
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a+")  # noqa: SIM115 - held until release()
        except OSError as err:
            raise TrainingInputError(f"--output_dir {out_dir}: cannot write there ({err.strerror}: "
                                     f"{err.filename})") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().split()
            self.file.close()
            who = f"PID {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
            raise TrainingInputError(f"--output_dir {out_dir} is in use by another run ({who}, which holds "
                                     f"{self.path}): wait for it to end or stop it, or choose another --output_dir"
                                     ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            warn(f"warning: cannot lock {self.path} ({err.strerror}): this filesystem has no flock, so another run "
                 f"started into --output_dir {out_dir} while this one runs would not be refused")
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        """Unlock (even where a forked DataLoader worker still holds the file open) and close."""
        if not self.file.closed:
            with suppress(OSError):  # never locked: a filesystem without flock
                fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def run_results(out_dir: Path) -> list[str]:
    """The results of a run in `out_dir` (paths relative to it, sorted): checkpoints, metrics.jsonl, final weights."""
    return sorted(p.relative_to(out_dir).as_posix() for pattern in RESULTS for p in out_dir.glob(pattern))


def _listing(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def remove_run_results(out_dir: Path) -> list[str]:
    """Delete the results of the run in `out_dir` and what goes with them (`RESULTS`, `ALSO_OVERWRITTEN`); returns
    the deleted names."""
    doomed = sorted({p for pattern in RESULTS + ALSO_OVERWRITTEN for p in out_dir.glob(pattern)
                     if p.parent == out_dir})  # checkpoints/* go with checkpoints/
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [p.name for p in doomed]


def resolve_resume(out_dir: Path, cfg: Config, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint this run continues (`--resume_from_checkpoint`), or None. `latest` skips damaged checkpoints
    with a warning; when every one is damaged it is an error naming them, unless --overwrite_output_dir (they are
    deleted with the other results: the run starts afresh)."""
    spec = cfg.train.resume_from_checkpoint
    if spec != "latest":
        return find_checkpoint(str(out_dir), spec, warn=warn) if spec else None
    resume, damaged = latest_checkpoint(str(out_dir), warn=warn)
    if resume is None and damaged and not cfg.train.overwrite_output_dir:
        problems = "; ".join(f"{path.name}: {problem}" for path, problem in damaged)
        raise TrainingInputError(f"--resume_from_checkpoint latest: no usable checkpoint in {out_dir / 'checkpoints'}, "
                                 f"every one is damaged ({problems}): resume from a good copy with "
                                 f"--resume_from_checkpoint PATH, or pass --overwrite_output_dir to delete them and "
                                 f"start afresh")
    return resume


def check_results(out_dir: Path, cfg: Config, resume: Path | None, warn: Callable[[str], None]) -> None:
    """Refuse to mix this run with the results of another run in `out_dir`, or delete them (--overwrite_output_dir).
    A run that continues one of the folder's own checkpoints continues its run: nothing to check."""
    if resume is not None and resume.resolve().parent == (out_dir / "checkpoints").resolve():
        return
    found = run_results(out_dir)
    if found and cfg.train.overwrite_output_dir:
        warn(f"--overwrite_output_dir: deleted the previous run's results in {out_dir}: "
             f"{', '.join(remove_run_results(out_dir))}")
    elif found:
        held = f"--output_dir {out_dir} holds another run's results ({_listing(found)})"
        if resume is not None:
            raise TrainingInputError(f"{held}, which a run resumed from {resume} (another folder's checkpoint) must "
                                     f"not mix with: choose another --output_dir, or pass --overwrite_output_dir to "
                                     f"delete them first")
        if cfg.train.resume_from_checkpoint == "latest":
            raise TrainingInputError(f"{held} but no checkpoint to resume from (--resume_from_checkpoint latest): "
                                     f"pass --overwrite_output_dir to delete them and start afresh, or choose another "
                                     f"--output_dir")
        raise TrainingInputError(f"{held}: continue that run with --resume_from_checkpoint latest, pass "
                                 f"--overwrite_output_dir to delete them and start afresh, or choose another "
                                 f"--output_dir")
    elif cfg.train.resume_from_checkpoint == "latest":
        warn(f"no complete checkpoint in {out_dir / 'checkpoints'}: starting from scratch")


@contextmanager
def own_output_dir(accelerator, cfg: Config, warn: Callable[[str], None] = print):
    """Claim `--output_dir` for this run and yield the checkpoint it continues (None: it starts afresh), checked
    against this run's options (`check_config_change`); the lock is released when the block ends, however it ends.
    The main process locks the folder, finds the checkpoint and applies the rules above; the other ranks then find
    the same checkpoint. A failure on any rank is a failure on all (`together`)."""
    out_dir = Path(cfg.train.output_dir)
    lock = None

    def claim() -> Path | None:
        nonlocal lock
        if accelerator.is_main_process:
            lock = OutputDirLock(out_dir, warn)
        resume = resolve_resume(out_dir, cfg, warn)
        if resume is not None:
            check_config_change(resume, cfg, warn=warn)  # before anything is deleted
        if accelerator.is_main_process:
            check_results(out_dir, cfg, resume, warn)
        return resume

    try:
        yield together(accelerator, claim, f"claiming --output_dir {out_dir}", main_first=True)
    finally:
        if lock is not None:
            lock.release()
