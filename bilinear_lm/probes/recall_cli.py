"""Multi-query associative recall (MQAR) by Zoology's protocol: the lr sweep per model and point, a table.

``bilinear-recall`` once installed, ``python eval/recall.py`` in a checkout (same arguments). The data, models and
training are ``bilinear_lm.probes.recall`` (``mqar``, ``run_recall``, ``RecallConfig``; its docstring states the
protocol and where it differs from Zoology's). Every (point, seed, model, lr) is one run: trained on a fixed set of
``--train-examples`` for at most ``--epochs`` epochs, stopped after the first epoch whose validation accuracy reaches
``--target``. The table keeps, per model, point and seed, the lr with the best validation accuracy and shows its test
accuracy on fresh examples and the model's state floats per layer, with each run's cost (steps, examples seen, seconds,
s/step, the CPU); ``recall_vs_state.png`` plots accuracy against state beside Zoology's published points. The results
file is resumed: a run already there (or in a ``--skip-runs-in`` file) is not run again, and an interrupted run goes on
from its last finished epoch (``checkpoints/`` in the output folder holds each unfinished run). ``--report`` runs
nothing: it merges results files (e.g. of sweeps run apart) into one results.json, table and plot in ``--output-dir``.

    bilinear-recall --points 64x4 --models llama --threads 1 --output-dir runs/recall      # Zoology's 4 lrs
    bilinear-recall --points 64x4,128x8,256x16 --models llama,bilinear-conv --output-dir runs/recall
    bilinear-recall --points 64x4 --models llama --lrs 2.154e-3 --train-examples 20000 --epochs 16 --output-dir r
    bilinear-recall --points 128x8 --models bilinear-conv --num-layers 4 --output-dir runs/hybrid \\
        --extra '{"layer_types": ["bilinear", "bilinear", "bilinear", "full_attention"], "num_attention_heads": 4,
                  "num_key_value_heads": 4, "use_rope": false}'      # a 3:1 hybrid
    bilinear-recall --report runs/recall/results.json,runs/hybrid/results.json --output-dir runs/all
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

from ..utils import keep_freed_memory
from .cli import (add_config_flags, config_from_args, flag_error, merge_results_files, parse_list, read_results_file,
                  run_checkpoint)
from .recall import (POINTS, RECALL_MODELS, ZOOLOGY_LRS, RecallConfig, parse_point, recall_data, recall_model,
                     run_recall, state_floats, zoology_batch_size)
from .report import plot_recall_vs_state, recall_table


def run_key(model: str, seed: int, config: dict | None) -> str:
    """What identifies a run in the results file (a sweep skips the runs already there): model, seed and the whole
    ``RecallConfig`` (``asdict``). Runs recorded without a config match no new run."""
    return json.dumps([model, seed, config], sort_keys=True)


def recorded_run_key(run: dict) -> str:
    """``run_key`` of a run as recorded in a results file."""
    return run_key(run["model"], run["seed"], run.get("config"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", "--point", default="64x4",
                   help=f"comma-separated LENGTHxPAIRS: Zoology's {', '.join(POINTS)} or any other (default: 64x4)")
    p.add_argument("--models", default="llama", help=f"comma-separated, from {', '.join(RECALL_MODELS)}")
    p.add_argument("--lrs", default=",".join(map(str, ZOOLOGY_LRS)),
                   help="comma-separated lrs, each a run; the table keeps the best by validation accuracy "
                        "(default: Zoology's logspace(-4, -2, 4))")
    p.add_argument("--seeds", default="0", help="comma-separated seeds: the data and the model's initialization")
    p.add_argument("--batch-size", type=int, default=None,
                   help="training batch size (default: Zoology's, 512 up to length 128, 256 at 256, 65536 / length "
                        "beyond)")
    p.add_argument("--extra", type=json.loads, default={}, metavar="JSON",
                   help='further BilinearConfig keys for the bilinear models, e.g. \'{"conv_width": 2}\'')
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--log-every", type=int, default=1, metavar="N",
                   help="print the training loss and validation accuracy every N epochs (0: only each run's result)")
    p.add_argument("--output-dir", default="runs/recall",
                   help="results.json (resumed), table.md and recall_vs_state.png")
    p.add_argument("--report", default=None, metavar="FILES",
                   help="run nothing: merge these comma-separated results.json files into --output-dir's "
                        "results.json, table.md and recall_vs_state.png")
    p.add_argument("--skip-runs-in", default=None, metavar="FILES",
                   help="comma-separated results.json files of other folders whose runs are not run again (e.g. "
                        "cells of this sweep run apart into their own --output-dir)")
    add_config_flags(p, RecallConfig, exclude=("seq_len", "num_pairs", "batch_size", "lr", "extra"))
    return p


def write_recall_report(runs: list[dict], out: Path) -> str:
    """Write ``out``'s table.md and recall_vs_state.png for ``runs``; return the table. Runs recorded before the state
    column get their model's state floats, built from their config."""
    for r in runs:
        if r.get("state_floats") is None and r.get("config"):
            config = RecallConfig(**r["config"])
            r["state_floats"] = state_floats(recall_model(r["model"], config), config.seq_len)
    table = recall_table(runs)
    (out / "table.md").write_text(table)
    plot_recall_vs_state(runs, out / "recall_vs_state.png")
    return table


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        out = Path(args.output_dir)
        runs = merge_results_files(
            parse_list(args.report, str, "--report"), out, recorded_run_key,
            lambda r: f"{r['model']} seed {r['seed']} lr {r['lr']:g} point {r['point']}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(runs, indent=1))
        print(write_recall_report(runs, out))
        print(f"wrote {out}/results.json, table.md and recall_vs_state.png from {len(runs)} runs")
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(RECALL_MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(RECALL_MODELS)}")
    try:
        points = [parse_point(p) for p in args.points.split(",") if p.strip()]
    except ValueError as err:
        raise SystemExit(f"--points: {err}") from None
    lrs, seeds = parse_list(args.lrs, float, "--lrs"), parse_list(args.seeds, int, "--seeds")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    runs = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {recorded_run_key(r) for r in runs}
    for path in map(Path, parse_list(args.skip_runs_in, str, "--skip-runs-in") if args.skip_runs_in else []):
        done |= {recorded_run_key(r) for r in read_results_file(path, "--skip-runs-in")}
    for seq_len, pairs in points:
        batch = args.batch_size or zoology_batch_size(seq_len)
        for seed in seeds:
            data = None  # one data set per point and seed, shared by every model and lr
            for model in models:
                for lr in lrs:
                    try:
                        config = config_from_args(RecallConfig, args, seq_len=seq_len, num_pairs=pairs,
                                                  batch_size=batch, lr=lr)
                    except ValueError as err:
                        raise flag_error(err, RecallConfig) from None
                    key = run_key(model, seed, dataclasses.asdict(config))
                    if key in done:
                        continue
                    checkpoint = run_checkpoint(out, key)
                    try:
                        data = data if data is not None else recall_data(config, seed)
                        run = run_recall(model, config, seed, data=data, device=args.device, checkpoint=checkpoint,
                                         log=lambda line: print(line, flush=True), log_every=args.log_every)
                    except ValueError as err:
                        raise SystemExit(f"error: {err}") from None
                    # the file as it is now (another sweep into this folder may have added runs), plus this run
                    runs = json.loads(results_path.read_text()) if results_path.exists() else []
                    runs.append(run)
                    tmp = results_path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(runs, indent=1))
                    tmp.replace(results_path)  # atomic: an interrupted sweep resumes from here
                    checkpoint.unlink(missing_ok=True)
    print(write_recall_report(runs, out))
    return 0
