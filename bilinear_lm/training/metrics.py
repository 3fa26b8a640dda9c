"""Training metrics: OUTPUT_DIR/metrics.jsonl (one JSON record per line), its loss plot, this process's peak memory
and the closing summary line of a run."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


def append_metrics(path: Path, record: dict) -> None:
    """Append ``record`` as one JSON line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsLog:
    """OUTPUT_DIR/metrics.jsonl (written by the main process) and the Accelerate trackers (`--report_to`)."""

    def __init__(self, accelerator, path: Path):
        self.accelerator, self.path = accelerator, path

    def start(self, resumed_at: int | None) -> None:
        """A fresh run starts an empty file; a resumed one drops the records past its checkpoint's step."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        if resumed_at is None:
            self.path.unlink()
            return
        keep = [r for r in read_metrics(self.path) if r["step"] <= resumed_at]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def log(self, record: dict) -> None:
        """``record`` (a dict with a `step`) to the file and its numbers to the trackers."""
        if self.accelerator.is_main_process:
            append_metrics(self.path, record)
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                             step=record["step"])


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """Training and validation loss against the step, from metrics.jsonl, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (`getrusage(RUSAGE_SELF).ru_maxrss`), in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10, 1)  # bytes on macOS, KiB elsewhere


def last_value(records: list[dict], key: str) -> dict | None:
    """The last record that has ``key``."""
    return next((r for r in reversed(records) if key in r), None)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def run_summary(records: list[dict], step: int, train_seconds: float, wall_seconds: float, tokens: int,
                out_dir: Path, device_peak_bytes: int | None = None) -> str:
    """The closing line of a run: steps and time, tokens/s, the final training and validation loss (from
    metrics.jsonl's ``records``), peak memory, and where the model and checkpoints are."""
    train, val = last_value(records, "loss"), last_value(records, "val_loss")
    losses = [f"train loss {train['loss']:.4f}" if train else "no train loss logged",
              f"val loss {val['val_loss']:.4f} (ppl {val['val_ppl']:.2f}, step {val['step']})" if val
              else "not evaluated (--eval_interval 0)"]
    memory = f"peak memory {peak_rss_mib() / 1024:.2f} GiB RSS" + (
        f", {device_peak_bytes / 2 ** 30:.2f} GiB on the GPU" if device_peak_bytes else "")
    checkpoints = sorted((Path(out_dir) / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    where = f"model in {out_dir}" + (f", checkpoints in {Path(out_dir) / 'checkpoints'} (newest {checkpoints[-1].name})"
                                     if checkpoints else "")
    return (f"done: {step} steps in {_duration(wall_seconds)} ({_duration(train_seconds)} training, "
            f"{tokens / max(train_seconds, 1e-9):,.0f} tokens/s), {', '.join(losses)}, {memory}; {where}")
