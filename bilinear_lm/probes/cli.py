"""State-tracking probes: train on short sequences, test length generalization (CLI, sweeps, tables, plots).

``bilinear-probes`` once installed, ``python eval/state_tracking.py`` in a checkout (same arguments).

The models, the training protocol and the metrics are the library's ``bilinear_lm.probes`` (``run_probe``,
driven by a ``ProbeConfig``; this CLI maps its flags onto one). Protocol (Ebrahimi & Memisevic, NeurIPS 2025):
train with a per-position cross-entropy loss on lengths drawn uniformly from 2..10 (batch 64, Adam), test on
1,000 fresh sequences of length 500 and report final-position accuracy. Model selection and stopping use a
held-out validation set at a length well beyond training (default 250, half the test length: in our runs models
perfect at length 40 or 100 could still fail at 500), never training accuracy: the weights with the best
validation (accuracy, -loss) are kept, and training stops once validation accuracy has been perfect for
``--patience`` steps (or when ``--steps`` / ``--max-seconds`` run out).

Beyond the paper's protocol, ``--state-consistency W`` adds W x a center loss on the recurrent state of the
bilinear models (``bilinear_lm.probes.state_consistency_loss``): same training data, lengths and labels, but
prefixes with the same label are pulled onto one state direction, so that what the model fits at lengths 2-10 is
a finite automaton on those directions and holds at any length.

    bilinear-probes --task modular_addition --m 5 --model bilinear-full
    bilinear-probes --task parity --model lstm --steps 2000 --output parity.json
    bilinear-probes --task automaton --automaton-file my_fsm.json --model bilinear-cp
    bilinear-probes --task random_fsm --m 25 --model bilinear-cp --state-size 32 --rank 640 \
        --state-consistency 5 --batch-size 256 --max-seconds 150
    bilinear-probes --sweep --tasks parity,modular_addition --ms 5,10 \
        --models bilinear-full,bilinear-diagonal,lstm --seeds 0,1 --output-dir runs/probes
    bilinear-probes --report runs/a/results.json,runs/b/results.json --output-dir runs/probes

Models (every model maps token ids to logits; the first ``num_classes`` logits are the class scores):
- ``bilinear-<mixer>`` for mixer in cp, full, block_diagonal, rotation, diagonal, positive_diagonal: the paper's
  minimal model (embedding -> one bilinear recurrence -> linear readout of the normalized state);
  ``--gate`` adds the LM's output gate.
- ``lstm``: torch.nn.LSTM (``lstm-2`` for two layers).
- ``transformer-{1,2,4}``: LlamaForCausalLM with 1/2/4 layers (RoPE, 4 heads).
- ``mamba-{1,2,4}``: MambaForCausalLM with 1/2/4 layers.

Metrics per test length L: ``final_acc`` (position L), ``beyond_train_acc`` (mean accuracy over
positions > max training length), and their chance-normalized versions
``(acc - chance) / (1 - chance)`` with chance = 1 / num_classes; ``per_position_acc`` (the
accuracy at position t of a length-L sequence equals final-position accuracy at length t, since the
models are causal and prefixes of samples are samples) is what the accuracy-vs-length plot shows.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from .config import ProbeConfig
from .models import MODEL_NAMES, model_spec
from .report import markdown_table, run_key, write_report
from .tasks import TASK_NAMES, USES_M, Task, make_task
from .training import check_state_consistency, run_probe


def parse_range(s: str) -> tuple[int, int]:
    try:
        lo, _, hi = str(s).partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"--train-lengths must look like 2-10, got {s!r}") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"--train-lengths must satisfy 1 <= lo <= hi, got {s!r}")
    return lo, hi


def parse_list(s: str, typ=int, flag: str = "") -> list:
    try:
        out = [typ(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} must be a comma-separated list, got {s!r}") from None
    if not out:
        raise SystemExit(f"{flag} is empty")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=TASK_NAMES, help="task for a single run")
    p.add_argument("--m", type=int, default=None, help="modulus / number of states (tasks that use it)")
    p.add_argument("--model", default="bilinear-full", help=f"one of {', '.join(MODEL_NAMES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-symbols", type=int, default=None, help="random_fsm alphabet size (default m)")
    p.add_argument("--fsm-seed", type=int, default=0, help="random_fsm transition-table seed")
    p.add_argument("--permutation-symbols", choices=("elements", "generators"), default="elements")
    p.add_argument("--automaton-file", default=None, help="JSON automaton for --task automaton")
    p.add_argument("--train-lengths", default="2-10")
    p.add_argument("--test-lengths", default="500", help="comma-separated, e.g. 50,100,500")
    p.add_argument("--val-length", type=int, default=250)
    p.add_argument("--val-size", type=int, default=100)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--steps", type=int, default=10000, help="maximum training steps")
    p.add_argument("--max-seconds", type=float, default=None, help="optional wall-clock budget per run")
    p.add_argument("--patience", type=int, default=2000, help="stop after validation accuracy is perfect this many steps")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="Adam lr (default 3e-3 bilinear, 1e-3 baselines)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="cosine: decay to 0 over --steps or --max-seconds, whichever ends first")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0 = off)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--state-size", type=int, default=128, help="bilinear state size")
    p.add_argument("--rank", type=int, default=None, help="bilinear rank (default: state size; number of task symbols for full)")
    p.add_argument("--block-size", type=int, default=2, help="bilinear block_diagonal block size")
    p.add_argument("--write-channel", action="store_true",
                   help="bilinear-cp: add the homogeneous write channel (BilinearConfig.write_channel)")
    p.add_argument("--gate", action="store_true",
                   help="bilinear: multiply the readout by the LM's output gate silu(W_g x) (default: the paper's linear "
                        "readout of the normalized state)")
    p.add_argument("--state-consistency", type=float, default=0.0, metavar="WEIGHT",
                   help="bilinear: add WEIGHT x a center loss pulling together the recurrent states of prefixes with the "
                        "same label (for tasks whose label is the automaton state; 0 = off, the paper's protocol)")
    p.add_argument("--num-heads", type=int, default=4, help="transformer attention heads")
    p.add_argument("--eval-tokens", type=int, default=8192, help="tokens per evaluation chunk (memory bound)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (machine is shared)")
    p.add_argument("--output", default=None, help="results JSON for a single run")
    p.add_argument("--verbose", action="store_true")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", action="store_true", help="run the grid tasks x ms x models x seeds")
    g.add_argument("--tasks", default="parity,modular_addition")
    g.add_argument("--ms", default="5", help="values of m for tasks that use it")
    g.add_argument("--models", default="bilinear-full,bilinear-cp,bilinear-diagonal,lstm")
    g.add_argument("--seeds", default="0")
    g.add_argument("--output-dir", default="state_tracking_runs",
                   help="sweep output: results.json, table.md, accuracy_vs_length.png")
    g.add_argument("--report", default=None,
                   help="only build table.md + PNG (and a merged results.json) from these comma-separated results "
                        "JSONs, e.g. of sweeps run in parallel")
    return p


def task_from_args(name: str, m, args) -> Task:
    return make_task(name, m, num_symbols=args.num_symbols, fsm_seed=args.fsm_seed,
                     symbols=args.permutation_symbols, path=args.automaton_file)


def config_from_args(args) -> ProbeConfig:
    """The flags of a probe run as the library's ProbeConfig."""
    return ProbeConfig(
        train_lengths=parse_range(args.train_lengths),
        test_lengths=tuple(parse_list(args.test_lengths, int, "--test-lengths")),
        val_length=args.val_length, val_size=args.val_size, test_size=args.test_size, steps=args.steps,
        max_seconds=args.max_seconds, patience=args.patience, eval_every=args.eval_every, batch_size=args.batch_size,
        lr=args.lr, lr_schedule=args.lr_schedule, grad_clip=args.grad_clip, state_consistency=args.state_consistency,
        eval_tokens=args.eval_tokens, hidden_size=args.hidden_size, state_size=args.state_size, rank=args.rank,
        block_size=args.block_size, gate=args.gate, write_channel=args.write_channel, num_heads=args.num_heads,
        verbose=args.verbose)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    except ValueError as e:  # library errors name ProbeConfig fields: show them as the flags that set them
        message = re.sub(r"ProbeConfig\.(\w+)", lambda f: "--" + f.group(1).replace("_", "-"), str(e))
        raise SystemExit(f"error: {message}") from None


def _main(args) -> int:
    if args.report:
        runs = []
        for path in parse_list(args.report, str, "--report"):
            if not Path(path).is_file():
                raise SystemExit(f"--report: no results file at {path} (a sweep writes OUTPUT_DIR/results.json)")
            runs += json.loads(Path(path).read_text())["runs"]
        out_dir = Path(args.output_dir)
        write_report(runs, out_dir)
        (out_dir / "results.json").write_text(json.dumps({"runs": runs}, indent=1))
        print(f"wrote {out_dir}/results.json, table.md and accuracy_vs_length.png from {len(runs)} runs")
        return 0
    if args.sweep:
        tasks = parse_list(args.tasks, str, "--tasks")
        for t in tasks:
            if t not in TASK_NAMES and not t.lower().startswith("permutation_"):
                raise SystemExit(f"unknown task {t!r} in --tasks; choose from {list(TASK_NAMES)}")
        ms, models, seeds = parse_list(args.ms, int, "--ms"), parse_list(args.models, str, "--models"), parse_list(args.seeds, int, "--seeds")
        config = config_from_args(args)
        for mdl in models:
            model_spec(mdl, config)
        grid = [task_from_args(t, m, args) for t in tasks for m in (ms if t in USES_M else [None])]
        for task in grid:  # refuse a bad combination before any run, not in the middle of the sweep
            for mdl in models:
                check_state_consistency(task, mdl, config.state_consistency)
        out_dir = Path(args.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        res_path = out_dir / "results.json"
        runs = json.loads(res_path.read_text())["runs"] if res_path.exists() else []
        done = {run_key(r) for r in runs}
        if done:
            print(f"resuming: {len(done)} runs already in {res_path}")
        for task in grid:
            for mdl in models:
                for seed in seeds:
                    key = run_key({"task": task.name, "task_params": task.params, "model": mdl, "seed": seed,
                                   "state_consistency": config.state_consistency})
                    if key in done:
                        continue
                    runs.append(run_probe(task, mdl, seed, config))
                    res_path.write_text(json.dumps({"runs": runs}, indent=1))
        write_report(runs, out_dir)
        print(f"wrote {res_path}, {out_dir / 'table.md'}, {out_dir / 'accuracy_vs_length.png'}")
        print(markdown_table(runs))
        return 0
    if not args.task:
        raise SystemExit("give --task TASK for a single run, --sweep for a grid, or --report results.json")
    config = config_from_args(args)
    model_spec(args.model, config)
    task = task_from_args(args.task, args.m, args)
    result = run_probe(task, args.model, args.seed, config)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"runs": [result]}, indent=1))
        print(f"wrote {args.output}")
    return 0
