"""Checkpoints: `accelerator.save_state` plus the `TrainState`, written so that a killed run never leaves a
checkpoint that looks complete but is not (temporary directory, marker file last, atomic rename)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .config import TrainingInputError

DONE_MARKER = "CHECKPOINT_COMPLETE"


@dataclass
class TrainState:
    """Where training stands: saved with every checkpoint (`trainer_state.json`) and restored on resume, so the step
    count, the data order and the training clock continue where they stopped."""

    step: int = 0               # optimizer steps done
    epoch: int = 0              # pass over the training data in progress (0-based)
    batches_done: int = 0       # micro-batches of this epoch consumed
    train_seconds: float = 0.0  # wall-clock spent in training steps (not evaluation or checkpoints), over all resumes

    @classmethod
    def load(cls, checkpoint: Path) -> TrainState:
        saved = json.loads((checkpoint / "trainer_state.json").read_text())
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})  # older ones lack train_seconds


def find_checkpoint(output_dir: str, spec: str) -> Path | None:
    """`latest` -> newest complete OUTPUT_DIR/checkpoints/step_N (None if there is none); else a path."""
    if spec == "latest":
        done = [p for p in (Path(output_dir) / "checkpoints").glob("step_*") if (p / DONE_MARKER).exists()]
        return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)
    path = Path(spec)
    if not (path / DONE_MARKER).exists():
        raise TrainingInputError(f"--resume_from_checkpoint {spec!r}: not a complete checkpoint directory "
                                 f"(expected {path / DONE_MARKER}); use 'latest' or OUTPUT_DIR/checkpoints/step_N")
    return path


def save_checkpoint(accelerator, output_dir: str, state: TrainState, tokenizer) -> None:
    """accelerator.save_state into a temporary directory, marker written last, then an atomic rename to
    OUTPUT_DIR/checkpoints/step_N. Every process calls it."""
    final = Path(output_dir) / "checkpoints" / f"step_{state.step}"
    tmp = final.with_name(f".tmp_step_{state.step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, scheduler, RNG states of every rank
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
        with open(tmp / DONE_MARKER, "w") as f:
            f.write(f"{state.step}\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
