"""Train a probe model on short sequences and test its length generalization: :func:`run_probe`.

Protocol (Ebrahimi & Memisevic, NeurIPS 2025): per-position cross-entropy on lengths drawn uniformly from
``train_lengths`` (batch 64, Adam), test on fresh sequences of ``test_lengths`` and report final-position
accuracy. Model selection and stopping use a held-out validation set at a length well beyond training (default
250), never training accuracy: the weights with the best validation (accuracy, -loss) are kept, and training
stops once validation accuracy has been perfect for ``patience`` steps (or when ``steps`` / ``max_seconds`` run
out). Optionally (``state_consistency`` > 0, bilinear models) a center loss on the recurrent state and the memory
heads' read-outs, read with ``output_mixer_states=True``, see :func:`state_consistency_loss`.

Metrics per test length L: ``final_acc`` (position L), ``beyond_train_acc`` (mean accuracy over positions >
max training length), their chance-normalized versions ``(acc - chance) / (1 - chance)``, and at the longest
test length ``per_position_acc`` (the accuracy at position t of a length-L sequence equals final-position accuracy
at length t, since the models are causal and prefixes of samples are samples).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ..utils import eval_mode, load_run_checkpoint, save_atomically
from .config import ProbeConfig
from .field_tasks import IGNORE, FieldTask
from .models import build_probe_model, class_logits, model_spec
from .tasks import Task

VAL_SEED, TEST_SEED = 1_000_003, 2_000_003  # data seeds shared by all runs: every model sees the same eval data


def check_state_consistency(task: Task, model_name: str, config: ProbeConfig) -> None:
    """Refuse ``config.state_consistency`` for a model without a bilinear state (hybrids have their bilinear layers')
    or a task whose labels merge states."""
    if config.state_consistency == 0:
        return
    if task.automaton is None:
        raise ValueError(f"state consistency needs a task whose label is the automaton state; {task.name} has no "
                         "automaton (set it to 0: drop --state-consistency)")
    if model_spec(model_name, config, task.vocab_size)[0] != "bilinear":
        raise ValueError(f"state_consistency reads the bilinear recurrent state; {model_name} has none (set it to 0: "
                         "drop --state-consistency)")
    if task.automaton.outputs.unique().numel() != task.automaton.num_states:
        raise ValueError(f"state consistency needs a task whose label is the automaton state, but {task.name}'s "
                         f"labels merge states ({task.automaton.num_states} states, {task.num_classes} classes)")


def state_consistency_loss(states, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Center loss on the recurrent state: squared distance of each position's state (each head scaled to unit
    norm, summed over heads) to the batch mean of the states with the same label, averaged over positions and
    tensors. ``states``: ``[B, T, heads, state]`` tensors (``outputs.mixer_states`` of a forward with
    ``output_mixer_states=True``, and its ``memory_reads`` with memory heads); ``labels``: ``[B, T]``.

    The state is only defined up to a positive factor per head, so it is compared as a direction (a sign flip
    counts as an error). When the label is the automaton state, a model at zero loss keeps one state per
    automaton state at lengths 2-10; its transitions then map those states onto each other, which holds at any
    length. Without it, the states of one automaton state drift apart with the history, slowly enough to pass at
    training lengths. The memory heads' read-outs get the same loss: without it, a memory that solves parity on
    lengths 2-10 (and fails at 500) was learnt before the tracking heads' solution (docs/results-history.md, memory heads).
    """
    if not states or any(h.shape[:2] != labels.shape for h in states):
        raise ValueError(f"state consistency needs one [B, T, heads, state] tensor per bilinear layer (and per "
                         f"memory read-out) for labels {tuple(labels.shape)}, got "
                         f"{[tuple(h.shape) for h in states or ()]} (pass the outputs.mixer_states, and "
                         "memory_reads, of the same forward, run with output_mixer_states=True)")
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


@torch.no_grad()
def evaluate(model, tokens, labels, num_classes: int, eval_tokens: int = 8192):
    """Chunked over the batch under no_grad -> (per-position accuracy [T], mean loss) over the labelled positions
    (``IGNORE``: unlabelled; a position with no label gets accuracy NaN)."""
    if tokens.dim() != 2 or tokens.shape != labels.shape or tokens.numel() == 0:
        raise ValueError(f"evaluate: tokens and labels must both be non-empty [batch, length], got shapes "
                         f"{tuple(tokens.shape)} and {tuple(labels.shape)}")
    scored = labels != IGNORE
    if not scored.any():
        raise ValueError(f"evaluate: every label is {IGNORE} (unlabelled): nothing to score")
    if labels[scored].min() < 0 or labels[scored].max() >= num_classes:
        raise ValueError(f"evaluate: labels must be class ids in [0, {num_classes}) (or {IGNORE}: unlabelled), got "
                         f"range [{int(labels[scored].min())}, {int(labels[scored].max())}] (pass the task's "
                         "num_classes)")
    with eval_mode(model):
        B, T = tokens.shape
        chunk = max(1, eval_tokens // T)
        correct = torch.zeros(T, dtype=torch.float64)
        loss_sum = 0.0
        for i in range(0, B, chunk):
            x, y = tokens[i:i + chunk], labels[i:i + chunk]
            logits = class_logits(model, x, num_classes)
            correct += (logits.argmax(-1) == y).sum(0).double()
            loss_sum += F.cross_entropy(logits.reshape(-1, num_classes), y.reshape(-1), reduction="sum",
                                        ignore_index=IGNORE).item()
    counted = scored.sum(0).double()
    return correct / counted, loss_sum / float(counted.sum())


def normalize(acc: float, chance: float) -> float:
    """Chance-normalized accuracy: 0 at chance, 1 when perfect."""
    return (acc - chance) / (1 - chance)


def default_lr(model_name: str) -> float:
    """The learning rate when none is given: 3e-3 for the 1-layer ``bilinear-<mixer>`` models (the paper's minimal
    model), 1e-3 for every deeper or other model."""
    return 3e-3 if model_name.startswith("bilinear") else 1e-3


def cosine_factor(step: int, steps: int, seconds: float, max_seconds: float | None) -> float:
    """Cosine decay from 1 to 0 over the run's budget: steps, or wall-clock seconds if that ends first."""
    progress = step / steps if max_seconds is None else max(step / steps, seconds / max_seconds)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def run_probe(task: Task, model_name: str, seed: int, config: ProbeConfig = ProbeConfig(), log=print,
              checkpoint: str | Path | None = None) -> dict:
    """Train model ``model_name`` on ``task`` and evaluate length generalization -> the result dict of the run.

    ``checkpoint``: a file the run is saved to at every validation (model, optimizer, data generator, the best
    weights so far, history) that it continues from; started with that file present, the run resumes after that
    validation and ends as the uninterrupted run would (with ``max_seconds``, the clock goes on from the saved
    training time)."""
    if not isinstance(task, (Task, FieldTask)):
        raise ValueError(f"run_probe: task must be a bilinear_lm.probes.Task (make_task(...)), got {type(task).__name__}")
    if not isinstance(config, ProbeConfig):
        raise ValueError(f"run_probe: config must be a ProbeConfig, got {type(config).__name__}")
    c = config
    lo, hi = c.train_lengths
    C, chance = task.num_classes, task.chance
    check_state_consistency(task, model_name, c)
    torch.manual_seed(seed)
    model, model_cfg = build_probe_model(model_name, task, c)
    model.train()
    lr = c.lr if c.lr is not None else default_lr(model_name)
    with_consistency = c.state_consistency > 0
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    val_x, val_y = task.sample(c.val_size, c.val_length, torch.Generator().manual_seed(VAL_SEED))

    best_key, best_state, best_step = (-1.0, -math.inf), copy.deepcopy(model.state_dict()), 0
    best_val_acc = best_val_loss = float("nan")
    perfect_since, stop_reason, history = None, "steps", []
    step, train_loss, elapsed = 0, float("nan"), 0.0
    loop_state = ("best_key", "best_state", "best_step", "best_val_acc", "best_val_loss", "perfect_since", "history",
                  "step", "train_loss", "elapsed")  # a checkpoint's, beside the model, Adam and the generators
    run = {"task": task.name, "task_params": task.params, "model": model_name, "seed": seed,
           "config": {k: v for k, v in asdict(c).items() if k != "verbose"}}  # what the checkpoint belongs to
    saved = load_run_checkpoint(checkpoint, run, {"model", "optimizer", "generator", "rng", *loop_state}, "probe run")
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        g.set_state(saved["generator"])
        torch.set_rng_state(saved["rng"])
        (best_key, best_state, best_step, best_val_acc, best_val_loss, perfect_since, history, step, train_loss,
         elapsed) = (saved[k] for k in loop_state)
        log(f"{task.name} {model_name} seed {seed}: resumed from {checkpoint} at step {step}")
    t0 = time.time() - elapsed
    while step < c.steps:
        step += 1
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        x, y = task.sample(c.batch_size, L, g)
        if with_consistency:
            out = model(input_ids=x, use_cache=False, output_mixer_states=True)
            logits = out.logits[..., :C].float()
            consistency = state_consistency_loss(out.mixer_states + (out.memory_reads or ()), y, C)
        else:
            logits = class_logits(model, x, C)
        ce = F.cross_entropy(logits.reshape(-1, C), y.reshape(-1))
        loss = ce + c.state_consistency * consistency if with_consistency else ce
        if not torch.isfinite(loss):
            stop_reason = "diverged"
            log(f"  step {step}: non-finite loss, stopping (keeping the best validated weights)")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if c.lr_schedule == "cosine":
            for group in opt.param_groups:
                group["lr"] = lr * cosine_factor(step, c.steps, time.time() - t0, c.max_seconds)
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        train_loss = ce.item()
        out_of_time = c.max_seconds is not None and time.time() - t0 > c.max_seconds
        if step % c.eval_every == 0 or step == c.steps or out_of_time:
            acc_pos, val_loss = evaluate(model, val_x, val_y, C, c.eval_tokens)
            val_acc = float(acc_pos.nanmean())
            history.append({"step": step, "train_loss": round(train_loss, 5), "val_acc": round(val_acc, 5),
                            "val_loss": round(val_loss, 5),
                            **({"consistency_loss": round(consistency.item(), 5)} if with_consistency else {})})
            key = (val_acc, -val_loss) if math.isfinite(val_loss) else (val_acc, -math.inf)
            if key >= best_key:
                best_key, best_state, best_step = key, copy.deepcopy(model.state_dict()), step
                best_val_acc, best_val_loss = val_acc, val_loss
            if val_acc == 1.0:
                perfect_since = step if perfect_since is None else perfect_since
            else:
                perfect_since = None
            if c.verbose:
                log(f"  step {step:6d} train_loss {train_loss:.4f} val_acc@{c.val_length} {val_acc:.4f} "
                    f"val_loss {val_loss:.4f} ({time.time() - t0:.1f}s)")
            if perfect_since is not None and step - perfect_since >= c.patience:
                stop_reason = "val_perfect"
                break
            if out_of_time:
                stop_reason = "max_seconds"
                break
            if checkpoint is not None and step < c.steps:
                values = (best_key, best_state, best_step, best_val_acc, best_val_loss, perfect_since, history, step,
                          train_loss, time.time() - t0)
                save_atomically({"run": run, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "generator": g.get_state(), "rng": torch.get_rng_state(),
                                 **dict(zip(loop_state, values))}, checkpoint)
    train_seconds = time.time() - t0
    model.load_state_dict(best_state)

    test, longest = {}, max(c.test_lengths)
    for T in c.test_lengths:
        x, y = task.sample(c.test_size, T, torch.Generator().manual_seed(TEST_SEED + T))
        acc_pos, test_loss = evaluate(model, x, y, C, c.eval_tokens)
        final = float(acc_pos[-1])
        beyond = float(acc_pos[hi:].nanmean()) if T > hi else float("nan")
        test[str(T)] = {
            "final_acc": final, "final_acc_norm": normalize(final, chance),
            "beyond_train_acc": beyond, "beyond_train_acc_norm": normalize(beyond, chance),
            "mean_acc": float(acc_pos.nanmean()), "loss": test_loss,
        }
        if T == longest:  # the plot's curve; at every length it made a field sweep's file 400 KB a run
            test[str(T)]["per_position_acc"] = [round(float(a), 4) for a in acc_pos]
    result = {
        "task": task.name, "task_params": task.params, "m": task.params.get("m"), "model": model_name, "seed": seed,
        "vocab_size": task.vocab_size, "num_classes": C, "chance": chance,
        "config": asdict(c), "model_config": model_cfg, "num_params": sum(p.numel() for p in model.parameters()),
        "lr": lr, "lr_schedule": c.lr_schedule, "state_consistency": c.state_consistency,
        "batch_size": c.batch_size, "train_lengths": [lo, hi],
        "val_length": c.val_length, "val_size": c.val_size, "test_size": c.test_size,
        "steps": step, "seconds": round(train_seconds, 2), "eval_seconds": round(time.time() - t0 - train_seconds, 2),
        "stop_reason": stop_reason, "best_step": best_step, "best_val_acc": best_val_acc, "best_val_loss": best_val_loss,
        "test": test, "history": history,
        # the field's scaled accuracy (Grazzi et al.) with test_lengths 40..256: final-position accuracy pooled over
        # the test lengths, each counted equally, chance-normalized
        "pooled_final_acc_norm": normalize(sum(t["final_acc"] for t in test.values()) / len(test), chance),
    }
    Tmax = str(longest)
    log(f"{task_label(result)} {model_name} seed {seed}: final acc @{Tmax} "
        f"{test[Tmax]['final_acc']:.3f} (norm {test[Tmax]['final_acc_norm']:.3f}), beyond-train acc "
        f"{test[Tmax]['beyond_train_acc']:.3f}; {step} steps, {train_seconds:.1f}s, stop: {stop_reason}, "
        f"best val acc {best_val_acc:.4f} @ step {best_step}")
    return result


def task_label(r: dict) -> str:
    """Task name as logs, tables and plots show it (with m, the permutation symbols or the automaton's name)."""
    p = r["task_params"]
    if "m" in p and r["task"] != "parity":
        return f"{r['task']} m={p['m']}"
    if "group" in p:
        return f"{r['task']}" + (" (gens)" if p.get("symbols") == "generators" else "")
    if r["task"] == "automaton":
        return f"automaton {p.get('name', '')}".strip()
    return r["task"]
