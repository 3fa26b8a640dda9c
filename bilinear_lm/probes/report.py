"""Results of probe runs as tables and plots: state tracking (``markdown_table``, ``plot_accuracy_vs_length``,
``write_report``) and MQAR recall (``recall_table``, ``plot_recall_vs_state``); ``run_key`` identifies a run in a
results file."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .training import task_label


def run_key(r: dict) -> tuple:
    """What identifies a run in a results file (a sweep skips the runs already there): task, model, seed and its
    whole ``config`` (``asdict(ProbeConfig)``) but ``verbose``, which changes only the log. Runs recorded without
    a config (older results files) match no new run."""
    config = {k: v for k, v in (r.get("config") or {}).items() if k != "verbose"}
    return (r["task"], json.dumps(r["task_params"], sort_keys=True), r["model"], r["seed"],
            json.dumps(config, sort_keys=True))


def model_label(r: dict) -> str:
    """Model name as tables and plots show it (runs with state consistency are separate rows)."""
    w, name = r.get("state_consistency", 0.0), r["model"]
    return f"{name} +consistency {w:g}" if w else name


def _groups(runs: list[dict]):
    tasks, models, cells = [], [], {}
    for r in runs:
        t, mdl = task_label(r), model_label(r)
        if t not in tasks:
            tasks.append(t)
        if mdl not in models:
            models.append(mdl)
        cells.setdefault((t, mdl), []).append(r)
    return tasks, models, cells


def _longest(r: dict) -> str:
    return max(r["test"], key=int)


def markdown_table(runs: list[dict]) -> str:
    tasks, models, cells = _groups(runs)
    lengths = sorted({_longest(r) for r in runs}, key=int)
    Ls = "/".join(lengths)

    def fmt(vals):
        if not vals:
            return "-"
        mean = sum(vals) / len(vals)
        return f"{mean:.2f}" if len(vals) == 1 else f"{mean:.2f} ({min(vals):.2f}-{max(vals):.2f})"

    out = []
    pooled = [r for r in runs if len(r["test"]) > 1 and "pooled_final_acc_norm" in r]
    if pooled:  # the field's protocol (Grazzi et al.): scaled accuracy pooled over the test lengths, best of seeds
        spans = sorted({f"{min(map(int, r['test']))}-{max(map(int, r['test']))}" for r in pooled})
        out.append(f"### Scaled accuracy pooled over test lengths {'/'.join(spans)}, %: best of seeds (mean; seeds)\n")
        out.append("| model | " + " | ".join(tasks) + " |")
        out.append("|---|" + "---|" * len(tasks))
        for mdl in models:
            row = []
            for t in tasks:
                vals = [100 * r["pooled_final_acc_norm"] for r in cells.get((t, mdl), []) if r in pooled]
                row.append(f"{max(vals):.2f} ({sum(vals) / len(vals):.2f}; {len(vals)})" if vals else "-")
            out.append(f"| {mdl} | " + " | ".join(row) + " |")
        out.append("")
    for metric, title in (("final_acc", f"Final-position accuracy at length {Ls}"),
                          ("final_acc_norm", f"Chance-normalized final-position accuracy at length {Ls}"),
                          ("beyond_train_acc", f"Mean accuracy over positions beyond training, length {Ls}")):
        out.append(f"### {title} (mean over seeds, (min-max) when several)\n")
        out.append("| model | " + " | ".join(tasks) + " |")
        out.append("|---|" + "---|" * len(tasks))
        for mdl in models:
            row = [fmt([r["test"][_longest(r)][metric] for r in cells.get((t, mdl), [])]) for t in tasks]
            out.append(f"| {mdl} | " + " | ".join(row) + " |")
        out.append("")
    out.append("### Runs\n")
    out.append("| task | model | seed | params | final acc | norm | beyond-train acc | best val acc | steps | seconds | stop |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        te = r["test"][_longest(r)]
        out.append(f"| {task_label(r)} | {model_label(r)} | {r['seed']} | {r['num_params']} | {te['final_acc']:.3f} | "
                   f"{te['final_acc_norm']:.3f} | {te['beyond_train_acc']:.3f} | {r['best_val_acc']:.3f} | "
                   f"{r['steps']} | {r['seconds']:.1f} | {r['stop_reason']} |")
    return "\n".join(out) + "\n"


def model_color(i: int):
    """The ``i``-th model's color in the plots: tab20's 10 dark colors first, then their light twins, so 20 models
    each get their own (matplotlib's default cycle repeats after 10)."""
    import matplotlib

    return matplotlib.colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)


def plot_accuracy_vs_length(runs: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, models, cells = _groups(runs)
    n = len(tasks)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        chance = None
        for i, mdl in enumerate(models):
            rs = cells.get((t, mdl), [])
            if not rs:
                continue
            curves = [r["test"][_longest(r)]["per_position_acc"] for r in rs]
            T = min(len(c) for c in curves)
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(T)]
            ax.plot(range(1, T + 1), mean, label=mdl, lw=1.2, color=model_color(i))
            chance = rs[0]["chance"]
            hi = rs[0]["train_lengths"][1]
        ax.axvline(hi, color="gray", ls="--", lw=0.8)
        if chance is not None:
            ax.axhline(chance, color="gray", ls=":", lw=0.8)
        ax.set_title(t)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("sequence length (position)")
        ax.set_ylabel("accuracy")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("State tracking: accuracy vs length (dashed: longest training length, dotted: chance)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(markdown_table(runs))
    plot_accuracy_vs_length(runs, out_dir / "accuracy_vs_length.png")


# The RecallConfig fields that shape a model: a run whose value differs from the default is labelled with it, so that
# two widths of one model are two rows (and the lr sweep's best is chosen within a width, never across).
RECALL_SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "state_size")


def recall_label(r: dict, short: bool = False) -> str:
    """A recall run's model as tables name it: the model, its shape where it differs from RecallConfig's defaults
    (``hidden_size=128``) and its ``extra`` config keys, with layer types as a pattern (``B`` bilinear, ``A``
    attention: a 3:1 hybrid is ``BBBA``); ``short`` (a plot's legend): the model, its shape and the pattern only."""
    from .recall import RecallConfig

    default = RecallConfig()
    shape = [f"{k}={r[k]}" for k in RECALL_SHAPE_FIELDS if r.get(k, getattr(default, k)) != getattr(default, k)]
    extra = dict(r.get("extra") or {})
    if "layer_types" in extra:
        extra["layer_types"] = "".join("B" if t == "bilinear" else "A" for t in extra["layer_types"])
    if short:
        return " ".join([r["model"], *shape, *([extra["layer_types"]] if "layer_types" in extra else [])])
    return " ".join([r["model"], *shape, *([json.dumps(extra, sort_keys=True)] if extra else [])])


def _best_per_seed(cell: list[dict]) -> list[dict]:
    """The run each seed keeps (``recall.best_run``: the best validation accuracy over lrs) among ``cell``'s runs."""
    from .recall import best_run

    return [best_run([r for r in cell if r["seed"] == s]) for s in dict.fromkeys(r["seed"] for r in cell)]


def recall_table(runs: list[dict]) -> str:
    """MQAR results (``bilinear_lm.probes.recall``), markdown. The summary: rows models (with their ``extra`` keys, if
    any), columns points (``seq_len x pairs``), cells the test accuracy of the run with the best validation accuracy
    over lrs (``recall.best_run``), mean over seeds (with their count), and its lr; then every run with its cost
    (s/step: wall-clock seconds per training step; CPU s/step: the process's CPU time, which a shared machine's
    load does not inflate)."""
    cols = sorted({(r["seq_len"], r["num_pairs"]) for r in runs})
    rows = list(dict.fromkeys(recall_label(r) for r in runs))
    lines = ["| model | params | state floats / layer | " + " | ".join(f"{L}x{p}" for L, p in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for m in rows:
        mine, cells = [r for r in runs if recall_label(r) == m], []
        for L, p in cols:
            best = _best_per_seed([r for r in mine if (r["seq_len"], r["num_pairs"]) == (L, p)])
            if not best:
                cells.append("-")
                continue
            text = f"{sum(r['test_acc'] for r in best) / len(best):.3f}"
            text += " (lr " + ", ".join(f"{lr:.4g}" for lr in sorted({r["lr"] for r in best})) + ")"
            cells.append(text + (f" (n={len(best)})" if len(best) > 1 else ""))
        floats = ", ".join(f"{v:,.0f}" for v in dict.fromkeys(r["state_floats"] for r in mine
                                                             if r.get("state_floats") is not None)) or "-"
        lines.append(f"| {m} | {mine[0]['num_params'] / 1e3:.0f}k | {floats} | " + " | ".join(cells) + " |")
    lines += ["", "| model | point | seed | lr | train examples | valid acc | test acc | stop | epochs | steps | "
              "examples seen | seconds | s/step | CPU s/step |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {recall_label(r)} | {r['point']} | {r['seed']} | {r['lr']:.4g} | {r['train_examples']:,} | "
                     f"{r['valid_acc']:.3f} | {r['test_acc']:.3f} | {r['stop']} | {r['epochs_run']}/{r['epochs']} | "
                     f"{r['steps']:,} | {r['examples_seen']:,} | {r['seconds']:.0f} | {r['s_per_step']:.3f} | "
                     f"{r['cpu_s_per_step']:.3f} |")
    lines += ["", "Devices: " + "; ".join(dict.fromkeys(r["device"] for r in runs))]
    return "\n".join(lines) + "\n"


# Zoology's published recall against state size (HazyResearch/zoology, January 2026 figure; accuracy on its test mix
# of 4-256 pairs): (name, Zoology's "state size", accuracy). Not this repository's protocol or points: a reference
# curve for plot_recall_vs_state. Zoology's state size (model.py, `_compute_state_size`) is 4 bytes x the recurrent
# floats summed over its 2 layers (its Gated DeltaNet at width 64: a BaseConv layer, 64 x 3, and 2 heads of 32 x 64,
# 4 x 4,288 = 17,152; convolution windows not counted), so a point is drawn at ZOOLOGY_FLOATS_PER_LAYER x its size.
ZOOLOGY_PUBLISHED = (("DeltaNet", 9_000, 0.79), ("Gated DeltaNet", 17_000, 0.89), ("RWKV-7", 17_000, 0.82),
                     ("GLA", 4_700, 0.53), ("Mamba-2", 8_000, 0.52))
ZOOLOGY_FLOATS_PER_LAYER = 1 / (4 * 2)


def plot_recall_vs_state(runs: list[dict], path) -> None:
    """MQAR test accuracy (the best lr per model, point and seed, as :func:`recall_table`) against the state floats
    per layer (``recall.state_floats``), one marker per point, beside :data:`ZOOLOGY_PUBLISHED` (gray), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, size, acc in ZOOLOGY_PUBLISHED:
        floats = size * ZOOLOGY_FLOATS_PER_LAYER
        ax.scatter(floats, acc, color="gray", marker="x")
        ax.annotate(name, (floats, acc), fontsize=7, color="gray", xytext=(4, -8), textcoords="offset points")
    markers = dict(zip(sorted({r["point"] for r in runs}, key=lambda p: tuple(map(int, p.split("x")))), "osD^v<>"))
    models = list(dict.fromkeys(recall_label(r) for r in runs if r.get("state_floats") is not None))
    for i, model in enumerate(models):
        for point, marker in markers.items():
            best = _best_per_seed([r for r in runs if recall_label(r) == model and r["point"] == point and
                                   r.get("state_floats")])
            if best:
                ax.scatter([r["state_floats"] for r in best], [r["test_acc"] for r in best], marker=marker,
                           color=model_color(i), label=f"{recall_label(best[0], short=True)} {point}")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("state floats per layer (attention: its keys and values)")
    ax.set_ylabel("MQAR test accuracy")
    ax.set_title("Recall against state size (gray: Zoology's published points, its own test mix)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
