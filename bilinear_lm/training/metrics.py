"""Training metrics: OUTPUT_DIR/metrics.jsonl (one JSON record per line) and its loss plot."""
from __future__ import annotations

import json
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
