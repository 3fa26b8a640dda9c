"""Multi-query associative recall (MQAR) sweep: accuracy vs number of key-value pairs, per model (CLI and table).

``bilinear-recall`` once installed, ``python eval/recall.py`` in a checkout (same arguments). The data, models and
training are ``bilinear_lm.probes.recall`` (``mqar``, ``run_recall``, ``RecallConfig``); this CLI runs the grid,
resumes from its results file, and writes a markdown table.

    bilinear-recall --models bilinear,bilinear-conv,llama,lstm --pairs 4,8,16 \
        --seq-len 64 --steps 600 --output-dir runs/recall
    bilinear-recall --models llama,bilinear --pairs 4,8,16 --seq-len 64 --vocab-size 256 --hidden-size 64 \
        --lr 1e-3,3e-3,1e-2 --warmup-steps 100 --extra '{"conv_width": 2}' --output-dir runs/recall_sweep
    # the calibrated protocol (docs/probes.md): half the training sequences dense, Llama 1.000 at 4 pairs
    bilinear-recall --models llama --pairs 4,8,16 --seq-len 64 --vocab-size 256 --hidden-size 64 --state-size 16 \
        --steps 1500 --warmup-steps 200 --lr 1e-3 --dense-fraction 0.5 --output-dir runs/recall_dense
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from ..utils import keep_freed_memory
from .cli import add_config_flags, config_from_args, flag_error, parse_list
from .recall import RECALL_MODELS, RecallConfig, run_recall
from .report import recall_table


def run_key(model: str, seed: int, config: dict | None) -> str:
    """What identifies a run in the results file (a sweep skips the runs already there): model, seed and the whole
    ``RecallConfig`` (``asdict``). Runs recorded without a config (older results files) match no new run."""
    return json.dumps([model, seed, config], sort_keys=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bilinear,bilinear-conv,llama,lstm",
                   help=f"comma-separated, from {', '.join(RECALL_MODELS)}")
    p.add_argument("--pairs", default="4,8,16", help="numbers of key-value pairs (the grid's num_pairs)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output-dir", default="runs/recall")
    p.add_argument("--lr", default=None, help="Adam lr, or comma-separated lrs to sweep: the table shows each model's "
                   "best per number of pairs (default: 3e-3 for bilinear models, 1e-3 for the baselines)")
    p.add_argument("--extra", type=json.loads, default={}, metavar="JSON",
                   help='further BilinearConfig keys for the bilinear models, e.g. \'{"conv_width": 2}\'')
    p.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="print the training loss every N steps (default: only each run's result)")
    add_config_flags(p, RecallConfig, exclude=("num_pairs", "lr", "extra"))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(RECALL_MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(RECALL_MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    runs = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {run_key(r["model"], r["seed"], r.get("config")) for r in runs}
    lrs = parse_list(args.lr, float, "--lr") if args.lr else [None]
    for pairs in parse_list(args.pairs, int, "--pairs"):
        for seed in parse_list(args.seeds, int, "--seeds"):
            for model in models:
                for lr in lrs:
                    try:
                        config = config_from_args(RecallConfig, args, num_pairs=pairs, lr=lr)
                    except ValueError as err:
                        raise flag_error(err, RecallConfig) from None
                    if run_key(model, seed, dataclasses.asdict(config)) in done:
                        continue
                    try:
                        runs.append(run_recall(model, config, seed, log_every=args.log_every))
                    except ValueError as err:
                        raise SystemExit(f"error: {err}") from None
                    tmp = results_path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(runs, indent=1))
                    tmp.replace(results_path)  # atomic: an interrupted sweep resumes from here
    table = recall_table(runs)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0
