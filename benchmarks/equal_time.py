#!/usr/bin/env python
"""Language-model quality at equal wall-clock budgets: any train.py preset, any set of models and variants.

    python benchmarks/equal_time.py --preset shakespeare-char --output shakespeare_char.md
    python benchmarks/equal_time.py --preset tinystories --data-dir DATA --budgets 240 --seeds 0,1 \
        --workdir runs/tinystories --run "bilinear=" --run "bilinear+conv=--model.conv_width 4" \
        --run "llama=--model_type llama --learning_rate 2e-3"

Every ``--run LABEL=OVERRIDES`` is a train.py run of the preset with those overrides (default: bilinear, llama and
mamba as the preset has them). First each label's step time is measured in a short calibration run (labels that
differ only in optimizer settings or seed share one: they train at the same speed); then, for
every budget and seed, a fresh run trains ``budget / step time`` steps with a cosine schedule ending there and
is scored on the whole validation split. The step counts come from the calibration alone, so only the
calibrations need an otherwise idle machine: the training runs give the same losses however loaded the machine
is (``--jobs 2`` runs two at a time, one thread each; ``--jobs 1 --threads 1`` leaves the other core to other
work). Finished runs in ``--workdir`` are reused, and a run cut there
(stopped, killed, the machine gone) continues from the last of its ten saves.
``--record FILE`` keeps what a long comparison has measured where a checkout keeps it (commit it with the results):
every calibration and finished run is appended to FILE (JSON lines, with the CPU and date) as it ends, and one found
there, the same preset, steps and train.py flags, is not run again, even on another machine whose workdir is gone. A
comparison of hours can so be split across sessions, and its step counts stay those of the CPU that calibrated it.
Prints a table (params, tokens/s, ms/step, validation loss at each budget: mean over seeds and each seed);
``--output FILE`` also writes it to FILE.

The tinystories and gutenberg presets name Hub datasets, but their results in docs/results*.md were measured on local
files, which every run of them gets (before its own flags, which win): ``--data-dir DIR`` (default
$BILINEAR_LM_DATA_DIR) holding ``tinystories/tinystories_sample.txt`` and ``gutenberg/{train,validation}.jsonl``.
Other presets need no data folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "train.py"
PRESETS = REPO / "bilinear_lm" / "configs"
# nanoGPT's documented CPU recipe (0.80M parameters), run on this kind of machine: the char-level reference.
NANOGPT = {"shakespeare-char": {75: 1.886, 180: 1.68}}
DEFAULT_RUNS = ["bilinear=", "llama=--model_type llama", "mamba=--model_type mamba"]
# train.py flags that leave a step's time unchanged (optimizer settings, seed, initialization): runs differing only in
# these share a calibration.
UNTIMED_FLAGS = ("--learning_rate", "--min_lr_ratio", "--warmup_steps", "--weight_decay",
                 "--beta1", "--beta2", "--grad_clip", "--seed", "--model.initializer_range",
                 "--model.input_factor_init_std", "--model.input_factor_multiplier", "--model.dt_bias_init")
# The data each preset's results in docs/results.md were measured on, where it is not the preset's own (a Hub dataset):
# train.py flags, the files relative to the data folder (--data-dir, default $DATA_ENV), passed before a run's own
# flags (which win).
DATA_ENV = "BILINEAR_LM_DATA_DIR"
LOCAL_DATA = {"tinystories": [("--train_file", "tinystories/tinystories_sample.txt")],
              "gutenberg": [("--streaming", None), ("--train_file", "gutenberg/train.jsonl"),
                            ("--validation_file", "gutenberg/validation.jsonl")]}


def local_data(preset: str, data_dir: str | Path | None) -> list[str]:
    """train.py flags giving ``preset`` the local data its results were measured on ([] for other presets);
    ValueError (one line: the flag, the env var and the files needed) without ``data_dir``."""
    if preset not in LOCAL_DATA:
        return []
    files = [f for _, f in LOCAL_DATA[preset] if f]
    if not data_dir:
        raise ValueError(f"--preset {preset} runs on local data (its preset names a Hub dataset): pass --data-dir DIR "
                         f"or set {DATA_ENV}=DIR, DIR holding {' and '.join(files)}")
    missing = [f for f in files if not (Path(data_dir) / f).is_file()]
    if missing:
        raise ValueError(f"--preset {preset}: no {' or '.join(missing)} in the data folder {data_dir}")
    return [x for flag, f in LOCAL_DATA[preset] for x in (flag, str(Path(data_dir) / f) if f else "false")]


def train(preset: Path, out_dir: Path, max_steps: int, eval_interval: int, overrides: list[str], threads: int | None,
          eval_iters: int = 0, data_dir: str | Path | None = None, checkpoints: int = 0):
    """One train.py run; returns its metrics records. A finished run in out_dir (its final save) is reused. With
    ``checkpoints`` > 0 the run saves that many times (the newest kept) and a run cut in out_dir continues from its
    last save (train.py's resume: the same result as a run never cut) or, with none, starts again; the saves are
    deleted once it ends."""
    if not (out_dir / "config.json").exists():
        local = local_data(preset.stem, data_dir)
        saves = ["--save_interval", "0"] if not checkpoints else [
            "--save_interval", str(math.ceil(max_steps / checkpoints)), "--save_total_limit", "1",
            "--resume_from_checkpoint", "latest", "--overwrite_output_dir"]
        cmd = [sys.executable, str(TRAIN_SCRIPT), "--config", str(preset), *local, "--output_dir", str(out_dir),
               "--max_steps", str(max_steps), "--eval_interval", str(eval_interval), "--eval_iters", str(eval_iters),
               *saves, "--sample_tokens", "0", *overrides]
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=env)
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
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


def timing_overrides(overrides: list[str]) -> list[str]:
    """The overrides that can change a training step's time: all but ``UNTIMED_FLAGS`` (``--flag value`` or
    ``--flag=value``)."""
    kept, skip_value = [], False
    for token in overrides:
        if skip_value:
            skip_value = False
        elif token.split("=", 1)[0] in UNTIMED_FLAGS:
            skip_value = "=" not in token
        else:
            kept.append(token)
    return kept


class Record:
    """``--record FILE``: measured calibrations and runs by key (the preset, steps and train.py flags), read from FILE
    at the start and appended to it, one JSON line each with the CPU and date, as each ends (threads may add at once).
    Without a file: remembers nothing."""

    def __init__(self, path: Path | None):
        self.path, self.entries, self.lock, self.cpu = path, {}, threading.Lock(), None
        if path is None or not path.exists():
            return
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                entry = json.loads(line)
                self.entries[entry["key"]] = entry
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f"--record {path}: line {n} is not a record of this benchmark (a JSON object with a "
                                 f"'key'); mend or delete that line (the run it held is then run again)") from None

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def add(self, key: str, **fields) -> None:
        if self.path is None:
            return
        if self.cpu is None:
            from bilinear_lm.utils import cpu_name

            self.cpu = cpu_name()
        entry = {"key": key, **fields, "cpu": self.cpu, "date": date.today().isoformat()}
        with self.lock:
            self.entries[key] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


def parse_run(spec: str) -> tuple[str, list[str]]:
    label, sep, overrides = spec.partition("=")
    if not sep or not label or "/" in label:
        raise SystemExit(f"--run must look like LABEL=TRAIN_OVERRIDES (e.g. 'llama=--model_type llama'), got {spec!r}")
    return label, shlex.split(overrides)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare-char", help="a YAML preset in bilinear_lm/configs")
    parser.add_argument("--run", action="append", dest="runs", help="LABEL=TRAIN_OVERRIDES (repeatable)")
    parser.add_argument("--budgets", default="75,180", help="training seconds per run")
    parser.add_argument("--steps", type=int, help="equal steps instead: every run trains this many steps, no "
                        "calibration (a machine busy with other work then changes no result)")
    parser.add_argument("--seeds", default="1337", help="train.py --seed values; every budget runs every seed")
    parser.add_argument("--evals", type=int, default=8, help="validation points per run (for the plot)")
    parser.add_argument("--eval-iters", type=int, default=0, help="validation batches per point (0 = the whole split)")
    parser.add_argument("--calibration-steps", type=int, default=60, help="steps of the step-time calibration run")
    parser.add_argument("--log-interval", type=int, default=10, help="train.py log interval (>= 2 logs in calibration)")
    parser.add_argument("--jobs", type=int, default=1, help="training runs at a time (one thread each when > 1)")
    parser.add_argument("--threads", type=int, help="threads of each training run and calibration (default: 1 when "
                        "--jobs > 1, else torch's default); a calibration is kept per thread count")
    parser.add_argument("--output", type=Path, help="also write the table to this markdown file (replaced)")
    parser.add_argument("--plot", type=Path, help="loss-vs-time plot of the largest budget (PNG)")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (finished runs are reused); default: temporary")
    parser.add_argument("--record", type=Path, help="JSON lines of every calibration and finished run, appended as "
                        "each ends; those already there are not run again (a comparison split across sessions)")
    parser.add_argument("--data-dir", default=os.environ.get(DATA_ENV),
                        help=f"the local data of the tinystories and gutenberg presets (default: ${DATA_ENV})")
    args = parser.parse_args(argv)
    if not TRAIN_SCRIPT.is_file():
        parser.error(f"{TRAIN_SCRIPT} not found: this benchmark runs the repo's train.py, so it needs a source "
                     "checkout (run it there: python benchmarks/equal_time.py, or install with pip install -e)")
    preset = PRESETS / f"{args.preset}.yaml"
    if not preset.exists():
        raise SystemExit(f"--preset {args.preset!r}: no {preset}; presets: {sorted(p.stem for p in PRESETS.glob('*.yaml'))}")
    try:
        local_data(preset.stem, args.data_dir)
    except ValueError as e:
        parser.error(str(e))
    budgets = [int(b) for b in args.budgets.split(",")] if args.steps is None else [args.steps]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [parse_run(spec) for spec in (args.runs or DEFAULT_RUNS)]
    threads = args.threads or (1 if args.jobs > 1 else None)
    record = Record(args.record)

    with tempfile.TemporaryDirectory() as scratch:
        work = args.workdir or Path(scratch)

        def run(job) -> tuple[list[dict], int]:
            """One job's validation records and parameter count: from the record, else trained (then recorded)."""
            label, budget, seed, steps, overrides = job
            eval_interval = max(1, steps // args.evals)
            key = shlex.join([args.preset, str(steps), str(eval_interval), str(args.eval_iters), *overrides])
            if (done := record.get(key)) is not None:
                return done["evals"], done["params"]
            out_dir = work / f"{label}-{budget}-seed{seed}"
            records = train(preset, out_dir, steps, eval_interval, overrides, threads, args.eval_iters, args.data_dir,
                            checkpoints=10)
            evals, params = [r for r in records if "val_loss" in r], parameter_count(out_dir)
            record.add(key, label=label, budget=budget, seed=seed, steps=steps, threads=threads, params=params,
                       evals=evals, peak_rss_mib=max((r["peak_rss_mib"] for r in records if "peak_rss_mib" in r),
                                                     default=None))
            return evals, params

        rows, curves, jobs, calibrations = [], {}, [], {}
        for label, overrides in runs:  # calibrations: one at a time, on an idle machine
            extra = ["--log_interval", str(args.log_interval), *overrides]
            if args.steps is None:
                timed = timing_overrides(extra)
                if tuple(timed) not in calibrations:  # at the runs' thread count (one each with --jobs 2)
                    key = shlex.join([args.preset, str(args.calibration_steps), f"threads={threads}", *timed])
                    if (calib := record.get(key)) is None:
                        calib_dir = work / f"calib-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
                        logs = train(preset, calib_dir, args.calibration_steps, 0, timed, threads,
                                     data_dir=args.data_dir)
                        logged = [r["tokens_per_sec"] for r in logs if "tokens_per_sec" in r][1:]  # after the warm-up
                        calib = {"params": parameter_count(calib_dir), "step_s": seconds_per_step(logs),
                                 "tokens_per_sec": sum(logged) / len(logged)}
                        record.add(key, calibration=True, threads=threads, **calib)
                    calibrations[tuple(timed)] = (calib["params"], calib["step_s"], calib["tokens_per_sec"])
                params, step_s, tokens_per_sec = calibrations[tuple(timed)]
                rows.append((label, params, step_s, tokens_per_sec))
            else:
                rows.append((label, None, None, None))
            for budget in budgets:
                steps = budget if args.steps is not None else max(5, int(budget / step_s))
                for seed in seeds:
                    jobs.append((label, budget, seed, steps, [*extra, "--seed", str(seed)]))
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(run, jobs))
        losses = {}
        for (label, budget, seed, steps, _), (evals, params) in zip(jobs, results):
            losses.setdefault((label, budget), []).append(evals[-1]["val_loss"])
            print(f"{label}: " + (f"{budget} s budget = " if args.steps is None else "") + f"{steps} steps, seed {seed} "
                  f"-> val loss {evals[-1]['val_loss']:.3f}",
                  flush=True)
            if budget == max(budgets) and seed == seeds[0]:
                step_s = next(r[2] for r in rows if r[0] == label) or 1.0  # --steps: plot against steps
                curves[label] = [(r["step"] * step_s, r["val_loss"]) for r in evals]
            if args.steps is not None and budget == budgets[0] and seed == seeds[0]:
                i = next(i for i, r in enumerate(rows) if r[0] == label)
                rows[i] = (label, params, None, None)

    unit = "steps" if args.steps is not None else "s"
    header = "| run | params | tokens/s | ms/step | " + " | ".join(f"val loss @{b} {unit}" for b in budgets) + " |"
    lines = [header, "|" + "---|" * (4 + len(budgets))]
    for label, params, step_s, tokens_per_sec in rows:
        cells = []
        for b in budgets:
            vals = losses[(label, b)]
            mean = sum(vals) / len(vals)
            cells.append(f"**{mean:.3f}**" + (f" ({', '.join(f'{v:.3f}' for v in vals)})" if len(vals) > 1 else ""))
        speed = f"{tokens_per_sec:.0f} | {step_s * 1e3:.1f}" if step_s else "- | -"
        lines.append(f"| {label} | {params / 1e6:.2f}M | {speed} | " + " | ".join(cells) + " |")
    reference = NANOGPT.get(args.preset, {}) if args.steps is None else {}
    if reference:
        lines.append("| nanoGPT CPU recipe (reference) | 0.80M | 22,800 | 33.7 | "
                     + " | ".join(f"{reference[b]:.3f}" if b in reference else "-" for b in budgets) + " |")
    runs_note = "; ".join(f"{label}: `{' '.join(o) or '(preset)'}`" for label, o in runs)
    how = ("Each budget is a separate run of `budget / calibrated step time` steps whose cosine schedule ends there"
           if args.steps is None else f"Every run trains {args.steps} steps (equal data, not equal time)")
    scored = "the whole held-out split" if not args.eval_iters else f"its first {args.eval_iters} batches"
    note = f"Preset `{args.preset}`; seeds {seeds}. {how}; validation = {scored}. Runs: {runs_note}."
    table = "\n".join(lines + ["", note])
    print("\n" + table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, points in curves.items():
            ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xlabel("training seconds (calibrated, 2 CPU cores)" if args.steps is None else "steps")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(args.preset)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
