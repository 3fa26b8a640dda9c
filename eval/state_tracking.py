#!/usr/bin/env python
"""State-tracking probes: train on short sequences, test length generalization.

Protocol (Ebrahimi & Memisevic, NeurIPS 2025): train with a per-position cross-entropy loss on
lengths drawn uniformly from 2..10 (batch 64, Adam), test on 1,000 fresh sequences of length 500
and report final-position accuracy. Model selection and stopping use a held-out validation set at
a length well beyond training (default 250, half the test length: in our runs models perfect at
length 40 or 100 could still fail at 500), never training accuracy: the weights with the best
validation (accuracy, -loss) are kept, and training stops once validation accuracy has been
perfect for ``--patience`` steps (or when ``--steps`` / ``--max-seconds`` run out).

Beyond the paper's protocol, ``--state-consistency W`` adds W x a center loss on the recurrent state of the
bilinear models (see :func:`state_consistency_loss`): same training data, lengths and labels, but prefixes with the
same label are pulled onto one state direction, so that what the model fits at lengths 2-10 is a finite automaton
on those directions and holds at any length.

    python eval/state_tracking.py --task modular_addition --m 5 --model bilinear-full
    python eval/state_tracking.py --task parity --model lstm --steps 2000 --output parity.json
    python eval/state_tracking.py --task automaton --automaton-file my_fsm.json --model bilinear-cp
    python eval/state_tracking.py --task random_fsm --m 25 --model bilinear-cp --state-size 32 --rank 640 \
        --state-consistency 5 --batch-size 256 --max-seconds 150
    python eval/state_tracking.py --sweep --tasks parity,modular_addition --ms 5,10 \
        --models bilinear-full,bilinear-diagonal,lstm --seeds 0,1 --output-dir runs/probes
    python eval/state_tracking.py --report runs/a/results.json,runs/b/results.json --output-dir runs/probes

Models (one code path: every model maps token ids to logits; the first ``num_classes`` logits are
the class scores, so the vocabulary is sized max(num_symbols, num_classes) and untied):
- ``bilinear-<mixer>`` for mixer in cp, full, block_diagonal, rotation, diagonal, positive_diagonal:
  BilinearForCausalLM(num_hidden_layers=1, use_mlp=False, num_heads=1, use_gate=False) = the paper's
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
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from bilinear_lm.baselines import LSTMLanguageModel
from bilinear_lm.probes import TASK_NAMES, Task, make_task
from bilinear_lm.probes.tasks import USES_M
from bilinear_lm.utils import eval_mode

BILINEAR_MIXERS = ("cp", "full", "block_diagonal", "rotation", "diagonal", "positive_diagonal")
MODEL_NAMES = tuple(f"bilinear-{m}" for m in BILINEAR_MIXERS) + (
    "lstm", "lstm-2", "transformer-1", "transformer-2", "transformer-4", "mamba-1", "mamba-2", "mamba-4")
VAL_SEED, TEST_SEED = 1_000_003, 2_000_003  # data seeds shared by all runs: every model sees the same eval data


# ---------------------------------------------------------------------------- models
def _hf_build(model_type: str, cfg: dict, vocab_size: int):
    """Bilinear models go through bilinear_lm.baselines.build_model (the shared code path); the Llama /
    Mamba baselines are built here from explicit configs, because baselines.build_model sizes them to match
    a bilinear parameter count, whereas the probe grid fixes their depth (1/2/4) and width."""
    if model_type == "bilinear":
        from bilinear_lm.baselines import build_model

        return build_model("bilinear", dict(cfg), vocab_size)
    if model_type == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **cfg))
    if model_type == "mamba":
        from transformers import MambaConfig, MambaForCausalLM

        return MambaForCausalLM(MambaConfig(vocab_size=vocab_size, **cfg))
    raise ValueError(f"unknown model type {model_type!r}")


def default_rank(mixer: str, args, num_symbols: int) -> int:
    """--rank, else: `full` gets one state matrix per task symbol (rank = num_symbols, the paper's
    A(x) = sum_s x_s W_s for one-hot x), every other mixer rank = state size."""
    if args.rank:
        return args.rank
    return num_symbols if mixer == "full" else args.state_size


def model_spec(name: str, args, num_symbols: int = 2) -> tuple[str, dict]:
    """Model name -> (model_type, config dict without vocab_size)."""
    H = args.hidden_size
    if name.startswith("bilinear-"):
        mixer = name.split("-", 1)[1]
        if mixer not in BILINEAR_MIXERS:
            raise ValueError(f"unknown bilinear mixer {mixer!r}; choose one of {list(BILINEAR_MIXERS)}")
        cfg = dict(hidden_size=H, num_hidden_layers=1, num_heads=1, state_size=args.state_size,
                   rank=default_rank(mixer, args, num_symbols), mixer_type=mixer, use_mlp=False,
                   use_gate=args.gate, tie_word_embeddings=False)
        if mixer == "block_diagonal":
            cfg["block_size"] = args.block_size
        return "bilinear", cfg
    if name in ("lstm", "lstm-2"):
        return "lstm", dict(hidden_size=H, num_layers=2 if name == "lstm-2" else 1)
    kind, _, layers = name.partition("-")
    if kind in ("transformer", "mamba") and layers.isdigit() and int(layers) >= 1:
        L = int(layers)
        if kind == "transformer":
            heads = args.num_heads
            if H % heads:
                raise ValueError(f"--hidden-size {H} must be divisible by --num-heads {heads} for transformers")
            return "llama", dict(hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L, num_attention_heads=heads,
                                 num_key_value_heads=heads, max_position_embeddings=max(2048, args._max_len + 1),
                                 tie_word_embeddings=False, use_cache=False)
        return "mamba", dict(hidden_size=H, state_size=16, num_hidden_layers=L, expand=2, tie_word_embeddings=False,
                             use_cache=False)
    raise ValueError(f"unknown model {name!r}; choose one of {list(MODEL_NAMES)} (transformer-N / mamba-N take any N)")


def build_model(name: str, task: Task, args) -> tuple[nn.Module, dict]:
    vocab = max(task.vocab_size, task.num_classes)
    model_type, cfg = model_spec(name, args, task.vocab_size)
    if model_type == "lstm":
        model = LSTMLanguageModel(vocab, cfg["hidden_size"], cfg["num_layers"])
    else:
        model = _hf_build(model_type, cfg, vocab)
    return model, {"model_type": model_type, "vocab_size": vocab, **cfg}


def class_logits(model, tokens: torch.Tensor, num_classes: int) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits[..., :num_classes].float()


def capture_training_states(model) -> list:
    """Forward hooks on every bilinear layer's state norm: while the model trains, each forward appends that
    layer's recurrent states ``[B, T, heads, state]`` to the returned list (the caller clears it every step)."""
    from bilinear_lm.modeling.modeling_bilinear import BilinearStateNorm

    captured = []
    for module in model.modules():
        if isinstance(module, BilinearStateNorm):
            module.register_forward_hook(lambda mod, inp, out: captured.append(inp[0]) if mod.training else None)
    return captured


def check_state_consistency(task: Task, model_name: str, weight: float) -> None:
    if weight < 0 or not math.isfinite(weight):
        raise ValueError(f"--state-consistency must be a finite weight >= 0, got {weight}")
    if weight == 0:
        return
    if not model_name.startswith("bilinear-"):
        raise ValueError(f"--state-consistency reads the bilinear recurrent state; {model_name} has none (drop the flag)")
    if task.automaton.outputs.unique().numel() != task.automaton.num_states:
        raise ValueError(f"--state-consistency needs a task whose label is the automaton state, but {task.name}'s "
                         f"labels merge states ({task.automaton.num_states} states, {task.num_classes} classes)")


def state_consistency_loss(states: list, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Center loss on the recurrent state: squared distance of each position's state (each head scaled to unit
    norm, summed over heads) to the batch mean of the states with the same label, averaged over positions and
    layers. ``states``: one ``[B, T, heads, state]`` tensor per layer; ``labels``: ``[B, T]``.

    The state is only defined up to scale, so it is compared as a direction (a sign flip counts as an error).
    When the label is the automaton state, a model at zero loss keeps one state per automaton state at lengths
    2-10; its transitions then map those states onto each other, which holds at any length. Without it, the
    states of one automaton state drift apart with the history, slowly enough to pass at training lengths.
    """
    if not states or any(h.shape[:2] != labels.shape for h in states):
        raise ValueError(f"state consistency needs one [B, T, heads, state] tensor per bilinear layer for labels "
                         f"{tuple(labels.shape)}, got {[tuple(h.shape) for h in states]} (a forward that ran outside "
                         "training, or gradient checkpointing re-running the layers, breaks the capture)")
    y = labels.reshape(-1)
    onehot = F.one_hot(y, num_classes).to(states[0].dtype)
    counts = onehot.sum(0).clamp_min(1).unsqueeze(-1)
    total = 0.0
    for h in states:
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
        h = h.flatten(2).flatten(0, 1)
        centers = (onehot.T @ h) / counts
        total = total + (h - centers[y]).pow(2).sum(-1).mean()
    return total / len(states)


# ---------------------------------------------------------------------------- training / evaluation
@torch.no_grad()
def evaluate(model, tokens, labels, num_classes: int, eval_tokens: int = 8192):
    """Chunked over the batch under no_grad -> (per-position accuracy [T], mean loss)."""
    with eval_mode(model):
        B, T = tokens.shape
        chunk = max(1, eval_tokens // T)
        correct = torch.zeros(T, dtype=torch.float64)
        loss_sum = 0.0
        for i in range(0, B, chunk):
            x, y = tokens[i:i + chunk], labels[i:i + chunk]
            logits = class_logits(model, x, num_classes)
            correct += (logits.argmax(-1) == y).sum(0).double()
            loss_sum += F.cross_entropy(logits.reshape(-1, num_classes), y.reshape(-1), reduction="sum").item()
    return correct / B, loss_sum / (B * T)


def normalize(acc: float, chance: float) -> float:
    return (acc - chance) / (1 - chance)


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


def default_lr(model_name: str) -> float:
    return 3e-3 if model_name.startswith("bilinear") else 1e-3


def cosine_factor(step: int, steps: int, seconds: float, max_seconds: float | None) -> float:
    """Cosine decay from 1 to 0 over the run's budget: steps, or wall-clock seconds if that ends first."""
    progress = step / steps if max_seconds is None else max(step / steps, seconds / max_seconds)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def run_probe(task: Task, model_name: str, seed: int, args, log=print) -> dict:
    """Train one model on one task and evaluate length generalization -> result dict."""
    lo, hi = parse_range(args.train_lengths)
    test_lengths = parse_list(args.test_lengths, int, "--test-lengths")
    args._max_len = max(test_lengths + [args.val_length])
    C, chance = task.num_classes, task.chance
    check_state_consistency(task, model_name, args.state_consistency)
    torch.manual_seed(seed)
    model, model_cfg = build_model(model_name, task, args)
    model.train()
    lr = args.lr if args.lr is not None else default_lr(model_name)
    captured = capture_training_states(model) if args.state_consistency > 0 else None
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    val_x, val_y = task.sample(args.val_size, args.val_length, torch.Generator().manual_seed(VAL_SEED))

    best_key, best_state, best_step = (-1.0, -math.inf), copy.deepcopy(model.state_dict()), 0
    best_val_acc = best_val_loss = float("nan")
    perfect_since, stop_reason, history = None, "steps", []
    t0 = time.time()
    step = 0
    train_loss = float("nan")
    while step < args.steps:
        step += 1
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        x, y = task.sample(args.batch_size, L, g)
        ce = F.cross_entropy(class_logits(model, x, C).reshape(-1, C), y.reshape(-1))
        loss = ce
        if captured is not None:
            consistency = state_consistency_loss(captured, y, C)
            captured.clear()
            loss = ce + args.state_consistency * consistency
        if not torch.isfinite(loss):
            stop_reason = "diverged"
            log(f"  step {step}: non-finite loss, stopping (keeping the best validated weights)")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.lr_schedule == "cosine":
            for group in opt.param_groups:
                group["lr"] = lr * cosine_factor(step, args.steps, time.time() - t0, args.max_seconds)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        train_loss = ce.item()
        out_of_time = args.max_seconds is not None and time.time() - t0 > args.max_seconds
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            acc_pos, val_loss = evaluate(model, val_x, val_y, C, args.eval_tokens)
            val_acc = float(acc_pos.mean())
            history.append({"step": step, "train_loss": round(train_loss, 5), "val_acc": round(val_acc, 5),
                            "val_loss": round(val_loss, 5),
                            **({"consistency_loss": round(consistency.item(), 5)} if captured is not None else {})})
            key = (val_acc, -val_loss) if math.isfinite(val_loss) else (val_acc, -math.inf)
            if key >= best_key:
                best_key, best_state, best_step = key, copy.deepcopy(model.state_dict()), step
                best_val_acc, best_val_loss = val_acc, val_loss
            if val_acc == 1.0:
                perfect_since = step if perfect_since is None else perfect_since
            else:
                perfect_since = None
            if args.verbose:
                log(f"  step {step:6d} train_loss {train_loss:.4f} val_acc@{args.val_length} {val_acc:.4f} "
                    f"val_loss {val_loss:.4f} ({time.time() - t0:.1f}s)")
            if perfect_since is not None and step - perfect_since >= args.patience:
                stop_reason = "val_perfect"
                break
            if out_of_time:
                stop_reason = "max_seconds"
                break
    train_seconds = time.time() - t0
    model.load_state_dict(best_state)

    test = {}
    for T in test_lengths:
        x, y = task.sample(args.test_size, T, torch.Generator().manual_seed(TEST_SEED + T))
        acc_pos, test_loss = evaluate(model, x, y, C, args.eval_tokens)
        final = float(acc_pos[-1])
        beyond = float(acc_pos[hi:].mean()) if T > hi else float("nan")
        test[str(T)] = {
            "final_acc": final, "final_acc_norm": normalize(final, chance),
            "beyond_train_acc": beyond, "beyond_train_acc_norm": normalize(beyond, chance),
            "mean_acc": float(acc_pos.mean()), "loss": test_loss,
            "per_position_acc": [round(float(a), 4) for a in acc_pos],
        }
    result = {
        "task": task.name, "task_params": task.params, "m": task.params.get("m"), "model": model_name, "seed": seed,
        "vocab_size": task.vocab_size, "num_classes": C, "chance": chance,
        "model_config": model_cfg, "num_params": sum(p.numel() for p in model.parameters()),
        "lr": lr, "lr_schedule": args.lr_schedule, "state_consistency": args.state_consistency,
        "batch_size": args.batch_size, "train_lengths": [lo, hi],
        "val_length": args.val_length, "val_size": args.val_size, "test_size": args.test_size,
        "steps": step, "seconds": round(train_seconds, 2), "eval_seconds": round(time.time() - t0 - train_seconds, 2),
        "stop_reason": stop_reason, "best_step": best_step, "best_val_acc": best_val_acc, "best_val_loss": best_val_loss,
        "test": test, "history": history,
    }
    Tmax = str(max(test_lengths))
    log(f"{task_label(result)} {model_name} seed {seed}: final acc @{Tmax} "
        f"{test[Tmax]['final_acc']:.3f} (norm {test[Tmax]['final_acc_norm']:.3f}), beyond-train acc "
        f"{test[Tmax]['beyond_train_acc']:.3f}; {step} steps, {train_seconds:.1f}s, stop: {stop_reason}, "
        f"best val acc {best_val_acc:.4f} @ step {best_step}")
    return result


# ---------------------------------------------------------------------------- reporting
def run_key(r: dict) -> tuple:
    """What identifies a run in a results file (a sweep skips the runs already there)."""
    return (r["task"], json.dumps(r["task_params"], sort_keys=True), r["model"], r["seed"],
            r.get("state_consistency", 0.0))


def model_label(r: dict) -> str:
    """Model name as tables and plots show it (runs with state consistency are a separate row)."""
    w = r.get("state_consistency", 0.0)
    return f"{r['model']} +consistency {w:g}" if w else r["model"]


def task_label(r: dict) -> str:
    p = r["task_params"]
    if "m" in p and r["task"] != "parity":
        return f"{r['task']} m={p['m']}"
    if "group" in p:
        return f"{r['task']}" + (" (gens)" if p.get("symbols") == "generators" else "")
    if r["task"] == "automaton":
        return f"automaton {p.get('name', '')}".strip()
    return r["task"]


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
        for mdl in models:
            rs = cells.get((t, mdl), [])
            if not rs:
                continue
            curves = [r["test"][_longest(r)]["per_position_acc"] for r in rs]
            T = min(len(c) for c in curves)
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(T)]
            ax.plot(range(1, T + 1), mean, label=mdl, lw=1.2)
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


# ---------------------------------------------------------------------------- CLI
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


def check_model_name(name: str, args) -> None:
    args._max_len = 0
    model_spec(name, args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


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
        for mdl in models:
            check_model_name(mdl, args)
        grid = [task_from_args(t, m, args) for t in tasks for m in (ms if t in USES_M else [None])]
        for task in grid:  # refuse a bad combination before any run, not in the middle of the sweep
            for mdl in models:
                check_state_consistency(task, mdl, args.state_consistency)
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
                                   "state_consistency": args.state_consistency})
                    if key in done:
                        continue
                    runs.append(run_probe(task, mdl, seed, args))
                    res_path.write_text(json.dumps({"runs": runs}, indent=1))
        write_report(runs, out_dir)
        print(f"wrote {res_path}, {out_dir / 'table.md'}, {out_dir / 'accuracy_vs_length.png'}")
        print(markdown_table(runs))
        return 0
    if not args.task:
        raise SystemExit("give --task TASK for a single run, --sweep for a grid, or --report results.json")
    check_model_name(args.model, args)
    task = task_from_args(args.task, args.m, args)
    result = run_probe(task, args.model, args.seed, args)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"runs": [result]}, indent=1))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
