#!/usr/bin/env python
"""Char-level Tiny Shakespeare at equal wall-clock budgets: bilinear vs parameter-matched Llama and Mamba.

    python benchmarks/shakespeare_char.py --output benchmarks/RESULTS.md

For every model and budget (default 75 s and 180 s of training) the script measures the model's step time
in a short calibration run, then trains a fresh run of `train.py --config shakespeare-char.yaml` whose
cosine schedule ends at the budget, evaluating on the whole validation split (the last 10% of the
characters, nanoGPT's split). It prints a table (params, tokens/s, validation loss at each budget) next to
nanoGPT's documented CPU recipe run on this machine (0.80M parameters: 1.886 at 75 s, 1.68 at 180 s), and
writes a loss-vs-time plot. Run nothing else meanwhile: the budgets are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "train.py"
PRESET = REPO / "bilinear_lm" / "configs" / "shakespeare-char.yaml"
NANOGPT = {75: 1.886, 180: 1.68}  # nanoGPT's CPU recipe, run on this machine outside this repo (benchmarks/RESULTS.md)


def train(out_dir: Path, model_type: str, max_steps: int, eval_interval: int, extra: list[str]) -> list[dict]:
    """One train.py run of the preset; returns its metrics records. A finished run in out_dir is reused."""
    if (out_dir / "config.json").exists():  # train.py saves the final model last
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--config", str(PRESET), "--model_type", model_type,
           "--output_dir", str(out_dir), "--max_steps", str(max_steps), "--eval_interval", str(eval_interval),
           "--eval_iters", "0", "--save_interval", "0", "--sample_tokens", "0", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def seconds_per_step(records: list[dict]) -> float:
    """Mean training step time after the first logged interval (warm-up)."""
    logs = [r for r in records if "tokens_per_sec" in r]
    return (logs[-1]["train_seconds"] - logs[0]["train_seconds"]) / (logs[-1]["step"] - logs[0]["step"])


def parameter_count(checkpoint: Path) -> int:
    """Parameters stored in a checkpoint's safetensors header (tied weights are stored once); no torch needed."""
    with open(checkpoint / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bilinear,llama,mamba")
    parser.add_argument("--budgets", default="75,180", help="training seconds per run")
    parser.add_argument("--evals", type=int, default=8, help="validation points per run (for the plot)")
    parser.add_argument("--calibration-steps", type=int, default=60, help="steps of the step-time calibration run")
    parser.add_argument("--output", type=Path, help="append the table to this markdown file")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "shakespeare_char_loss.png")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (finished runs are reused); default: temporary")
    parser.add_argument("--log-interval", type=int, default=10, help="train.py log interval (>= 2 logs in calibration)")
    parser.add_argument("extra", nargs="*", help="extra train.py overrides, e.g. --learning_rate 2e-3")
    args = parser.parse_args(argv)
    if not TRAIN_SCRIPT.is_file():
        parser.error(f"{TRAIN_SCRIPT} not found: this benchmark runs the repo's train.py, so it needs a source "
                     "checkout (run it there: python benchmarks/shakespeare_char.py, or install with pip install -e)")
    budgets = [int(b) for b in args.budgets.split(",")]
    tokens_per_step = 12 * 64  # the preset's batch_size x block_size

    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.workdir or scratch
        for model_type in args.models.split(","):
            extra = ["--log_interval", str(args.log_interval), *args.extra]
            calib = train(Path(tmp) / f"{model_type}-calib", model_type, args.calibration_steps, 0, extra)
            step_s = seconds_per_step(calib)
            params = parameter_count(Path(tmp) / f"{model_type}-calib")
            losses, seconds = {}, {}
            for budget in budgets:
                steps = max(5, int(budget / step_s))
                records = train(Path(tmp) / f"{model_type}-{budget}", model_type, steps,
                                max(1, steps // args.evals), extra)
                evals = [r for r in records if "val_loss" in r]
                losses[budget], seconds[budget] = evals[-1]["val_loss"], evals[-1]["train_seconds"]
                if budget == max(budgets):
                    curves[model_type] = [(r["train_seconds"], r["val_loss"]) for r in evals]
                print(f"{model_type}: {budget} s budget = {steps} steps, {seconds[budget]:.0f} s of training "
                      f"-> val loss {losses[budget]:.3f}", flush=True)
            rows.append((model_type, params, tokens_per_step / step_s, step_s, losses, seconds))

    header = "| model | params | tokens/s | ms/step | " + " | ".join(f"val loss @{b} s" for b in budgets) + " |"
    lines = [header, "|" + "---|" * (4 + len(budgets))]
    for name, params, tok_s, step_s, losses, seconds in rows:
        lines.append(f"| {name} | {params / 1e6:.2f}M | {tok_s:.0f} | {step_s * 1e3:.1f} | "
                     + " | ".join(f"{losses[b]:.3f} ({seconds[b]:.0f} s)" for b in budgets) + " |")
    lines.append("| nanoGPT CPU recipe (reference) | 0.80M | 22,800 | 33.7 | "
                 + " | ".join(f"{NANOGPT.get(b, float('nan')):.3f}" for b in budgets) + " |")
    bilinear = next((r for r in rows if r[0] == "bilinear"), None)
    verdicts = []
    if bilinear:
        for b in budgets:
            if b in NANOGPT:
                ours = bilinear[4][b]
                verdicts.append(f"at {b} s bilinear {ours:.3f} vs nanoGPT {NANOGPT[b]:.3f}: "
                                + ("lower (better)" if ours < NANOGPT[b] else "NOT lower"))
    note = ("Each budget is a separate run whose cosine schedule ends at the budget; (N s) is the training time "
            "it actually took (evaluation excluded); validation = the whole last 10% of input.txt.")
    table = "\n".join(lines + ["", note, "", "; ".join(verdicts)])
    print("\n" + table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot(*zip(*points), marker="o", label=name)
    ax.scatter(list(NANOGPT), list(NANOGPT.values()), marker="x", color="k", label="nanoGPT (reference)")
    ax.set_xlabel("training seconds (2 CPU cores)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("char-level Tiny Shakespeare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    if args.output:
        with open(args.output, "a") as f:
            f.write(f"\nCommand: `python benchmarks/shakespeare_char.py {' '.join(sys.argv[1:])}`\n\n{table}\n\n"
                    f"![loss vs time]({args.plot.name})\n")


if __name__ == "__main__":
    main()
