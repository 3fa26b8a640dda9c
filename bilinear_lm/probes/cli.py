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
bilinear models (and the memory heads' read-outs; ``bilinear_lm.probes.state_consistency_loss``): same training
data, lengths and labels, but prefixes with the same label are pulled onto one state direction, so that what the
model fits at lengths 2-10 is a finite automaton on those directions and holds at any length.

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
``(acc - chance) / (1 - chance)`` with chance = 1 / num_classes; at the longest test length,
``per_position_acc`` (the accuracy at position t of a length-L sequence equals final-position accuracy
at length t, since the models are causal and prefixes of samples are samples) is what the
accuracy-vs-length plot shows.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import types
import typing
from pathlib import Path

import torch

from ..utils import keep_freed_memory
from .config import ProbeConfig
from .models import MODEL_NAMES, model_spec
from .report import markdown_table, run_key, write_report
from .tasks import TASK_NAMES, USES_M, Task, make_task
from .training import check_state_consistency, run_probe


def parse_list(s: str, typ=int, flag: str = "") -> list:
    try:
        out = [typ(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} must be a comma-separated list, got {s!r}") from None
    if not out:
        raise SystemExit(f"{flag} is empty")
    return out


def read_results_file(path: Path, flag: str):
    """The JSON of the results file ``path``, given by ``flag``; a missing file is refused with one line."""
    if not path.is_file():
        raise SystemExit(f"{flag}: no results file at {path} (a sweep writes OUTPUT_DIR/results.json)")
    return json.loads(path.read_text())


def merge_results_files(paths: list[str], out: Path, key, describe, runs_of=lambda data: data) -> list[dict]:
    """The runs of the results files ``paths`` (``runs_of`` the list in a file's JSON), in order, for a ``--report``
    into ``out``. Refused, one line each: a missing file, ``out``'s own results.json beside other files (the merge
    would overwrite a sweep's record; alone it re-renders its own report) and a run (``key``; runs recorded without a
    config are never duplicates) in two files, named by ``describe``."""
    runs, where = [], {}
    for path in map(Path, paths):
        data = read_results_file(path, "--report")
        if len(paths) > 1 and path.resolve() == (out / "results.json").resolve():
            raise SystemExit(f"--report: {path} is --output-dir's own results.json; give another --output-dir")
        for r in runs_of(data):
            if r.get("config") is not None and key(r) in where:
                raise SystemExit(f"--report: the run {describe(r)} is in both {where[key(r)]} and {path}; keep it in "
                                 f"one of them")
            where[key(r)] = path
            runs.append(r)
    return runs


def run_checkpoint(out_dir: Path, key: str) -> Path:
    """The file in ``out_dir/checkpoints/`` (made here) that holds the unfinished sweep run ``key``."""
    path = Path(out_dir) / "checkpoints" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must look like LO-HI, e.g. 2-10, got {text!r}") from None


def _int_list(text: str) -> tuple[int, ...]:
    """``50,100,500``; an item ``LO-HI`` is every integer from LO to HI (``40-256``: the field's test lengths)."""
    try:
        out = []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            lo, _, hi = item.partition("-")
            out += range(int(lo), int(hi) + 1) if hi else [int(lo)]
        return tuple(out)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers or LO-HI ranges, e.g. 50,100,500 or "
                                         f"40-256, got {text!r}") from None


def _flag_type(hint) -> dict:
    """argparse keywords (``type``, ``metavar``) and ``spell`` (the default as the flag would spell it) for a config
    field's type: ``X | None`` as X, ``tuple[int, int]`` as ``LO-HI``, ``tuple[int, ...]`` as a comma-separated list."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint in (int, float, str):
        return {"type": hint, "spell": str}
    args = typing.get_args(hint) if typing.get_origin(hint) is tuple else ()
    if args == (int, int):
        return {"type": _int_range, "metavar": "LO-HI", "spell": lambda v: "-".join(map(str, v))}
    if args == (int, ...):
        return {"type": _int_list, "metavar": "N,N,...", "spell": lambda v: ",".join(map(str, v))}
    raise TypeError(f"no command-line flag for a config field of type {hint}")


def add_config_flags(parser: argparse.ArgumentParser, config_cls, exclude=()) -> None:
    """One ``--field-name`` flag per field of the dataclass ``config_cls`` (but ``exclude``): type, default, help
    and further argparse keywords from the field (declared with :func:`bilinear_lm.probes.config.option`)."""
    hints = typing.get_type_hints(config_cls)
    group = parser.add_argument_group(f"{config_cls.__name__} settings")
    for f in dataclasses.fields(config_cls):
        if f.name in exclude:
            continue
        flag = dict(f.metadata)
        help_ = flag.pop("help")
        if hints[f.name] is bool:
            flag["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kind = _flag_type(hints[f.name])
            spell = kind.pop("spell")
            flag = {**kind, **flag}
            if f.default is not None:
                help_ += f" (default: {spell(f.default)})"
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default, help=help_, **flag)


def config_from_args(config_cls, args: argparse.Namespace, **values):
    """``config_cls`` from the flags :func:`add_config_flags` made, ``values`` overriding them (the fields left out
    of the flags keep their defaults unless set here)."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if f.name in vars(args)}
    return config_cls(**{**flags, **values})


def flag_error(error: ValueError, config_cls) -> SystemExit:
    """A config's ValueError as a command-line error: ``ProbeConfig.steps`` is shown as the flag ``--steps``."""
    message = re.sub(rf"\b{config_cls.__name__}\.(\w+)", lambda f: "--" + f.group(1).replace("_", "-"), str(error))
    return SystemExit(f"error: {message}")


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
    p.add_argument("--threads", type=int, default=1, help="torch threads (machine is shared)")
    p.add_argument("--output", default=None, help="results JSON for a single run")
    add_config_flags(p, ProbeConfig)
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", action="store_true", help="run the grid tasks x ms x models x seeds")
    g.add_argument("--tasks", default="parity,modular_addition")
    g.add_argument("--ms", default="5", help="values of m for tasks that use it")
    g.add_argument("--models", default="bilinear-full,bilinear-cp,bilinear-diagonal,lstm")
    g.add_argument("--seeds", default="0")
    g.add_argument("--output-dir", default="state_tracking_runs",
                   help="sweep output: results.json, table.md, accuracy_vs_length.png; a sweep called again skips "
                        "the runs in results.json and continues a cut run from its last validation "
                        "(checkpoints/ holds each unfinished run)")
    g.add_argument("--report", default=None,
                   help="only build table.md + PNG (and a merged results.json) from these comma-separated results "
                        "JSONs, e.g. of sweeps run in parallel")
    return p


def task_from_args(name: str, m, args) -> Task:
    return make_task(name, m, num_symbols=args.num_symbols, fsm_seed=args.fsm_seed,
                     symbols=args.permutation_symbols, path=args.automaton_file)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    try:
        return _main(args)
    except ValueError as e:  # library errors name ProbeConfig fields: show them as the flags that set them
        raise flag_error(e, ProbeConfig) from None


def _main(args) -> int:
    if args.report:
        out_dir = Path(args.output_dir)
        runs = merge_results_files(parse_list(args.report, str, "--report"), out_dir, run_key,
                                   lambda r: f"{r['task']} {r['model']} seed {r['seed']}", lambda data: data["runs"])
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
        config = config_from_args(ProbeConfig, args)
        for mdl in models:
            model_spec(mdl, config)
        grid = [task_from_args(t, m, args) for t in tasks for m in (ms if t in USES_M else [None])]
        for task in grid:  # refuse a bad combination before any run, not in the middle of the sweep
            for mdl in models:
                check_state_consistency(task, mdl, config)
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
                                   "config": dataclasses.asdict(config)})
                    if key in done:
                        continue
                    checkpoint = run_checkpoint(out_dir, json.dumps(key))
                    runs.append(run_probe(task, mdl, seed, config, checkpoint=checkpoint))
                    res_path.write_text(json.dumps({"runs": runs}, indent=1))
                    checkpoint.unlink(missing_ok=True)
        write_report(runs, out_dir)
        print(f"wrote {res_path}, {out_dir / 'table.md'}, {out_dir / 'accuracy_vs_length.png'}")
        print(markdown_table(runs))
        return 0
    if not args.task:
        raise SystemExit("give --task TASK for a single run, --sweep for a grid, or --report results.json")
    config = config_from_args(ProbeConfig, args)
    model_spec(args.model, config)
    task = task_from_args(args.task, args.m, args)
    result = run_probe(task, args.model, args.seed, config)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"runs": [result]}, indent=1))
        print(f"wrote {args.output}")
    return 0
