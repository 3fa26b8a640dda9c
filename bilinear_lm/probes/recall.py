"""Multi-query associative recall (MQAR) by Zoology's protocol (Arora et al. 2023, "Zoology: Measuring and Improving
Recall in Efficient Language Models", figure 2): :func:`mqar` makes the data, :func:`run_recall` trains one model at
one lr, :func:`sweep_lrs` runs the lr sweep and keeps the best run.

Data. A sequence of ``seq_len`` tokens starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...``: distinct keys
from the lower half of the vocabulary (``1 .. vocab_size / 2 - 1``; token 0 is the filler), distinct values from the
upper half. Then every key is queried once, at an even offset after the pairs, ``2 * num_pairs + 2 * g``, with the
gaps ``g`` distinct and drawn by a power law ``p(g) ~ (g + 1) ** (power_a - 1)`` (``power_a`` 0.01: short gaps are
the likeliest, as a repeated bigram in text is likeliest soon after the first); every other position is token 0.
The label at a query is its key's value (the token a causal LM predicts next there); every other label is -100, so
the loss and the accuracy count the answers only, and the LM head is applied at the answer positions only
(:func:`answer_logits`: the 8,192-way output layer would otherwise dominate a step).

Protocol (Zoology's figure 2; :data:`POINTS`): vocabulary 8,192; (seq_len, pairs) = (64, 4), (128, 8), (256, 16)
with batch 512, 512, 256; a fixed training set of 100,000 examples re-used for up to 64 epochs; AdamW (weight
decay 0.1), cosine decay to 0 over the epochs, no warmup; training stops after the first epoch whose validation
accuracy reaches 0.99; the best of the lrs ``logspace(-4, -2, 4)`` by validation accuracy; its accuracy on fresh
test examples is the result. Where this differs from Zoology: the models are this repository's (Llama with RoPE,
an MLP and ``num_heads`` heads, untied output embeddings, no dropout, where Zoology's attention has one head, learned
positions, no MLP, tied embeddings, dropout 0.1); validation (stopping, lr choice) and test are separate sets
(Zoology stops on its test set); the training set is reshuffled every epoch; the cosine decays every step; weight
decay applies to the weight matrices only (``baselines.optimizer_groups``).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..baselines import LSTMLanguageModel, build_model, gated_deltanet_keys, mamba2_keys, optimizer_groups
from ..modeling.cache_bilinear import cache_layer_tensors
from ..modeling.transformers_compat import returned_cache
from ..utils import cpu_name, eval_mode, load_run_checkpoint, save_atomically
from .config import option

IGNORE = -100
RECALL_MODELS = ("bilinear", "bilinear-conv", "bilinear-memory", "llama", "gated_deltanet", "gated_deltanet-neg",
                 "gated_deltanet-square", "gated_deltanet-square-neg", "gated_deltanet-zoology", "mamba2", "lstm")
POWER_A = 0.01  # Zoology's power law for the query gaps
ZOOLOGY_LRS = (1e-4, 4.642e-4, 2.154e-3, 1e-2)  # np.logspace(-4, -2, 4), to 4 digits
POINTS = {"64x4": (64, 4), "128x8": (128, 8), "256x16": (256, 16)}  # Zoology's figure 2: (seq_len, num_pairs)


def zoology_batch_size(seq_len: int) -> int:
    """Zoology's batch size for a sequence length: 512 up to length 128, then 256, 128, 64 at 256, 512, 1024."""
    return max(1, min(512, 65536 // seq_len))


def parse_point(text: str) -> tuple[int, int]:
    """``"128x8"`` -> ``(128, 8)`` (sequence length, pairs): the presets of :data:`POINTS` or any ``LxP``."""
    length, sep, pairs = text.strip().partition("x")
    if not (sep and length.isdigit() and pairs.isdigit()):
        raise ValueError(f"a recall point is LENGTHxPAIRS, e.g. {', '.join(POINTS)}; got {text!r}")
    return int(length), int(pairs)


def _distinct(n: int, k: int, low: int, high: int, generator) -> torch.Tensor:
    """``[n, k]`` integers from ``low .. high - 1``, distinct within each row, every such row equally likely."""
    span = high - low
    if math.prod(1 - i / span for i in range(k)) < 0.5:  # few choices: rank random numbers ([n, span] is small)
        return torch.rand(n, span, generator=generator).argsort(dim=1)[:, :k] + low
    x = torch.randint(low, high, (n, k), generator=generator)
    while True:  # redraw the rows with a repeat: a uniform row conditioned on no repeat
        s = x.sort(dim=1).values
        repeat = (s[:, 1:] == s[:, :-1]).any(dim=1)
        if not repeat.any():
            return x
        x[repeat] = torch.randint(low, high, (int(repeat.sum()), k), generator=generator)


def mqar(num_examples: int, seq_len: int, num_pairs: int, vocab_size: int = 8192, generator=None,
         power_a: float = POWER_A):
    """``(tokens, labels)``, both ``[num_examples, seq_len]`` long tensors (see the module docstring); the same
    ``generator`` state gives the same examples."""
    half = vocab_size // 2
    if num_pairs < 1 or 4 * num_pairs > seq_len:
        raise ValueError(f"mqar: need 1 <= num_pairs and 4 * num_pairs <= seq_len (the pairs, then a query and a "
                         f"filler per key), got num_pairs={num_pairs}, seq_len={seq_len}")
    if half - 1 < num_pairs:
        raise ValueError(f"mqar: vocab_size {vocab_size} has only {half - 1} keys for {num_pairs} distinct keys; "
                         "raise vocab_size")
    keys = _distinct(num_examples, num_pairs, 1, half, generator)
    values = _distinct(num_examples, num_pairs, half, vocab_size, generator)
    space = (seq_len - 2 * num_pairs) // 2  # query slots: the even offsets after the pairs
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    # key i is asked at the i-th gap drawn (without replacement, so the likeliest gaps tend to come first)
    gaps = torch.multinomial((p / p.sum()).expand(num_examples, space), num_pairs, replacement=False,
                             generator=generator)
    slots = 2 * num_pairs + 2 * gaps
    tokens = torch.zeros(num_examples, seq_len, dtype=torch.long)
    labels = torch.full((num_examples, seq_len), IGNORE, dtype=torch.long)
    tokens[:, 0:2 * num_pairs:2], tokens[:, 1:2 * num_pairs:2] = keys, values
    tokens.scatter_(1, slots, keys)
    labels.scatter_(1, slots, values)
    return tokens, labels


@dataclass(frozen=True)
class RecallConfig:
    """One MQAR run: the data (a point ``seq_len`` x ``num_pairs``, the set sizes), training (AdamW, cosine decay over
    ``epochs``, early stopping at ``target``) and the model's size (bilinear ``num_heads`` x ``state_size``, rank =
    state size; Llama with ``num_heads`` heads and an MLP 4x wide; all ``num_layers`` deep, ``hidden_size`` wide).
    The defaults are Zoology's first point at width 64. Each field's help says what it sets."""

    seq_len: int = option(64, "sequence length")
    num_pairs: int = option(4, "key-value pairs per sequence")
    vocab_size: int = option(8192, "vocabulary: keys from the lower half, values from the upper half")
    train_examples: int = option(100_000, "training examples: one fixed set, re-used (reshuffled) every epoch")
    valid_examples: int = option(1_000, "validation examples (early stopping and the choice of lr)")
    test_examples: int = option(3_000, "fresh test examples (the reported accuracy)")
    epochs: int = option(64, "at most this many epochs (the cosine decays to 0 at the last)")
    batch_size: int = option(512, "training batch size")
    lr: float = option(1e-3, "AdamW lr")
    weight_decay: float = option(0.1, "AdamW weight decay (weight matrices only)")
    target: float = option(0.99, "stop after the first epoch whose validation accuracy reaches this")
    hidden_size: int = option(64, "model width")
    num_layers: int = option(2, "model depth")
    num_heads: int = option(4, "bilinear and Llama heads")
    state_size: int = option(16, "bilinear state size per head")
    extra: dict = field(default_factory=dict)  # further BilinearConfig keys for the bilinear models

    def __post_init__(self):
        for name in ("seq_len", "num_pairs", "vocab_size", "train_examples", "valid_examples", "test_examples",
                     "epochs", "batch_size", "hidden_size", "num_layers", "num_heads", "state_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RecallConfig.{name} must be an integer >= 1, got {value!r}")
        for name, bound, ok in (("lr", "> 0", lambda v: v > 0), ("weight_decay", ">= 0", lambda v: v >= 0),
                                ("target", "in [0, 1]", lambda v: 0 <= v <= 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    not ok(value):
                raise ValueError(f"RecallConfig.{name} must be a finite number {bound}, got {value!r}")

    @property
    def point(self) -> str:
        return f"{self.seq_len}x{self.num_pairs}"


def recall_model(name: str, config: RecallConfig):
    """A causal LM for MQAR: ``bilinear`` (pure), ``bilinear-conv`` (``conv_width=4``; with ``extra`` layer types, a
    hybrid), ``bilinear-memory`` (``bilinear-conv`` with ``num_heads`` memory heads of keys and values
    ``hidden_size / num_heads``), ``llama``, ``gated_deltanet`` (``num_heads`` heads, keys of ``hidden_size / (2
    num_heads)``, values of ``hidden_size / num_heads``, convolution 4; ``gated_deltanet-neg``: its [-1, 1] form;
    ``gated_deltanet-square`` and ``-square-neg``: keys as wide as the values, ``hidden_size / num_heads``, the
    memory heads' shape, within 4% of their state floats; ``gated_deltanet-zoology``: Zoology's sizing, 2 heads of
    keys ``hidden_size / 2`` and values ``hidden_size``;
    Zoology's model alternates it with a BaseConv layer, which Qwen3.5 lacks: here every layer is Gated DeltaNet),
    ``mamba2`` (``2 num_heads`` heads of ``hidden_size / num_heads``, state 64) or ``lstm``, all ``num_layers`` deep
    and ``hidden_size`` wide, with untied input and output embeddings (tied, a 2-layer attention model of the
    bilinear stack stayed at ``1 / pairs``, 0.260, where untied it reached 0.981: docs/results-history.md)."""
    c = config
    if name in ("bilinear", "bilinear-conv", "bilinear-memory"):
        memory = {} if name != "bilinear-memory" else dict(
            memory_heads=c.num_heads, memory_key_size=c.hidden_size // c.num_heads,
            memory_value_size=c.hidden_size // c.num_heads)
        cfg = dict(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_heads=c.num_heads,
                   state_size=c.state_size, rank=c.state_size, conv_width=0 if name == "bilinear" else 4,
                   tie_word_embeddings=False, **{**memory, **c.extra})
        return build_model("bilinear", cfg, c.vocab_size, match_bilinear=False)
    if name == "llama":
        cfg = dict(hidden_size=c.hidden_size, intermediate_size=4 * c.hidden_size, num_hidden_layers=c.num_layers,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
                   max_position_embeddings=c.seq_len, tie_word_embeddings=False, use_cache=False)
        return build_model("llama", cfg, c.vocab_size, match_bilinear=False)
    if name in RECALL_MODELS and name.startswith("gated_deltanet"):
        sizes = {"gated_deltanet-zoology": dict(  # zoology/experiments/mqar_example_configs
                     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=c.hidden_size // 2,
                     linear_value_head_dim=c.hidden_size),
                 "gated_deltanet-square": dict(linear_key_head_dim=c.hidden_size // c.num_heads)}
        cfg = gated_deltanet_keys(c.hidden_size, c.num_heads, ["bilinear"] * c.num_layers, tie=False,
                                  intermediate_size=4 * c.hidden_size, allow_neg_eigval=name.endswith("-neg"),
                                  **sizes.get(name.removesuffix("-neg"), {}))
        return build_model("gated_deltanet", cfg, c.vocab_size, match_bilinear=False)
    if name == "mamba2":  # chunks of 64: transformers' 256 would pad a sequence of 64 to 256
        cfg = mamba2_keys(c.hidden_size, c.num_heads, c.num_layers, tie=False, chunk_size=64)
        return build_model("mamba2", cfg, c.vocab_size, match_bilinear=False)
    if name == "lstm":
        return build_model("lstm", dict(hidden_size=c.hidden_size, num_layers=c.num_layers), c.vocab_size,
                           match_bilinear=False)
    raise ValueError(f"unknown recall model {name!r}; choose one of {RECALL_MODELS}")


def hidden_states(model, tokens: torch.Tensor) -> torch.Tensor:
    """What a recall model's LM head reads, ``[B, T, hidden]``: the base model's last hidden state (bilinear models
    and hybrids, Llama, the peers), the LSTM's output."""
    if isinstance(model, LSTMLanguageModel):
        return model.lstm(model.embed(tokens))[0]
    return model.base_model(input_ids=tokens, use_cache=False).last_hidden_state


def answer_logits(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, answers)``: the LM head's fp32 logits ``[n, vocab]`` at the ``n`` answer positions (``labels !=
    -100``) only, and the answers ``[n]``: ``model(tokens).logits`` at those positions, without the head's cost
    at every other position."""
    asked = labels != IGNORE
    return model.get_output_embeddings()(hidden_states(model, tokens)[asked]).float(), labels[asked]


@torch.no_grad()
def state_floats(model, seq_len: int) -> float:
    """Floats the model carries from one position to the next after ``seq_len`` tokens, per layer, batch 1 (the
    x-axis of Zoology's recall-against-state plots): every tensor of its cache (recurrent states, convolution
    windows, an attention layer's keys and values), averaged over the layers; an LSTM's ``h`` and ``c``."""
    if isinstance(model, LSTMLanguageModel):
        return 2.0 * model.config.hidden_size
    device = next(model.parameters()).device
    with eval_mode(model):
        cache = returned_cache(model(torch.ones(1, seq_len, dtype=torch.long, device=device), use_cache=True))
    tensors = list(getattr(cache, "attention_conv_windows", {}).values())
    for layer in cache.layers:
        tensors += cache_layer_tensors(layer)
    return sum(t.numel() for t in tensors) / len(cache.layers)


@torch.no_grad()
def answer_accuracy(model, tokens, labels, batch_size: int = 500) -> float:
    """Fraction of the answers (``labels != -100``) whose argmax logit is the value."""
    correct = total = 0
    device = next(model.parameters()).device
    with eval_mode(model):
        for i in range(0, len(tokens), batch_size):
            logits, answers = answer_logits(model, tokens[i:i + batch_size].to(device, torch.long),
                                            labels[i:i + batch_size].to(device, torch.long))
            correct += int((logits.argmax(-1) == answers).sum())
            total += answers.numel()
    return correct / total


def recall_data(config: RecallConfig, seed: int = 0) -> dict:
    """The training, validation and test sets of a run (``{"train": (tokens, labels), "valid": ..., "test": ...}``),
    each from its own generator, so the three never share a draw: a function of the point, the vocabulary, the set
    sizes and ``seed``, the same for every model and lr. Stored as int16 (every token and -100 fit)."""
    c = config

    def make(n, offset):
        x, y = mqar(n, c.seq_len, c.num_pairs, c.vocab_size, torch.Generator().manual_seed(offset + seed))
        return (x.to(torch.int16), y.to(torch.int16)) if c.vocab_size <= 2**15 else (x, y)

    return {"train": make(c.train_examples, 0), "valid": make(c.valid_examples, 10**6),
            "test": make(c.test_examples, 2 * 10**6)}


def cpu_device() -> str:
    """A run's device on CPU: the CPU (:func:`bilinear_lm.utils.cpu_name`) and torch's thread count."""
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def _log_result(r: dict, log) -> None:
    log(f"mqar {r['point']} {r['model']} lr {r['lr']:.3g} seed {r['seed']}: valid {r['valid_acc']:.3f} test "
        f"{r['test_acc']:.3f} ({'target reached after' if r['stop'] == 'target' else 'target not reached in'} "
        f"{r['epochs_run']} epochs); cost {r['steps']} steps, "
        f"{r['examples_seen']:,} examples, {r['seconds']:.0f} s ({r['s_per_step']:.3f} s/step training, "
        f"{r['cpu_s_per_step']:.3f} s of process CPU time) on {r['device']}")


def run_recall(model_name: str, config: RecallConfig = RecallConfig(), seed: int = 0, log=print,
               data: dict | None = None, device: str = "cpu", log_every: int = 1,
               checkpoint: str | Path | None = None) -> dict:
    """Train ``model_name`` on the fixed training set of ``config`` (``data``: :func:`recall_data`'s, made here if
    None) at ``config.lr`` until validation accuracy reaches ``config.target`` or ``config.epochs`` run out -> a
    result dict: accuracies, the cost (steps, examples seen, seconds, s/step, the CPU) and the per-epoch history.
    ``log`` gets a line every ``log_every`` epochs (0: none) and the result's line. ``checkpoint``: a file the run is
    saved to after every epoch that it continues from (model, optimizer, schedule, data order, history); started with
    that file present, the run resumes after its epoch and ends as the uninterrupted run would; another run's file there
    (another model, seed or config) is refused, naming what differs."""
    c = config
    data = data if data is not None else recall_data(c, seed)
    train_x, train_y = data["train"]
    torch.manual_seed(seed)
    model = recall_model(model_name, c).to(device).train()
    opt = torch.optim.AdamW(optimizer_groups(model, c.weight_decay), lr=c.lr)
    steps_per_epoch = math.ceil(len(train_x) / c.batch_size)
    total = c.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1))))
    shuffle = torch.Generator().manual_seed(seed)
    history, step, seen, stop, train_seconds, train_cpu = [], 0, 0, "epochs", 0.0, 0.0
    run = {"model": model_name, "seed": seed, "config": asdict(c)}  # what the checkpoint belongs to
    loop_state = ("history", "step", "seen", "train_seconds", "train_cpu")
    saved = load_run_checkpoint(checkpoint, run, {"model", "optimizer", "schedule", "shuffle", *loop_state},
                                "recall run", map_location=device)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        shuffle.set_state(saved["shuffle"])
        history, step, seen, train_seconds, train_cpu = (saved[k] for k in loop_state)
        log(f"{model_name} {c.point} lr {c.lr:.3g}: resumed from {checkpoint} after epoch {len(history)}")
    t0 = time.perf_counter() - (history[-1]["seconds"] if history else 0.0)
    for epoch in range(len(history) + 1, c.epochs + 1):
        t_epoch, cpu_epoch, loss_sum = time.perf_counter(), time.process_time(), torch.zeros((), device=device)
        order = torch.randperm(len(train_x), generator=shuffle)
        for i in range(0, len(train_x), c.batch_size):
            batch = order[i:i + c.batch_size]
            logits, answers = answer_logits(model, train_x[batch].to(device, torch.long),
                                            train_y[batch].to(device, torch.long))
            loss = F.cross_entropy(logits, answers)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            loss_sum += loss.detach()
            step, seen = step + 1, seen + len(batch)
        train_seconds += time.perf_counter() - t_epoch
        train_cpu += time.process_time() - cpu_epoch
        valid = answer_accuracy(model, *data["valid"])
        history.append({"epoch": epoch, "steps": step, "train_loss": round(loss_sum.item() / steps_per_epoch, 4),
                        "valid_acc": valid, "seconds": round(time.perf_counter() - t0, 1)})
        if log_every and epoch % log_every == 0:
            log(f"{model_name} {c.point} lr {c.lr:.3g} epoch {epoch}/{c.epochs} (step {step}): training loss "
                f"{history[-1]['train_loss']:.4f}, valid acc {valid:.3f} ({history[-1]['seconds']:.0f} s)")
        if valid >= c.target:
            stop = "target"
            break
        if checkpoint is not None and epoch < c.epochs:
            save_atomically({"run": run, "model": model.state_dict(), "optimizer": opt.state_dict(),
                             "schedule": schedule.state_dict(), "shuffle": shuffle.get_state(), "history": history,
                             "step": step, "seen": seen, "train_seconds": train_seconds, "train_cpu": train_cpu},
                            checkpoint)
    seconds = time.perf_counter() - t0
    result = {"model": model_name, "seed": seed, "point": c.point,
              **{k: v for k, v in asdict(c).items() if k != "extra"}, "extra": dict(c.extra), "config": asdict(c),
              "num_params": sum(p.numel() for p in model.parameters()),
              "state_floats": state_floats(model, c.seq_len),
              "train_loss": history[-1]["train_loss"], "valid_acc": history[-1]["valid_acc"],
              "test_acc": answer_accuracy(model, *data["test"]), "stop": stop, "epochs_run": len(history),
              "steps": step, "examples_seen": seen,
              "seconds": round(seconds, 1), "train_seconds": round(train_seconds, 1),
              "s_per_step": round(train_seconds / step, 4), "cpu_s_per_step": round(train_cpu / step, 4),
              "device": cpu_device() if str(device) == "cpu" else str(device), "history": history}
    _log_result(result, log)
    return result


def best_run(runs: list[dict]) -> dict:
    """The run a sweep keeps: the highest validation accuracy (never the test's), the fewest steps among equals."""
    return max(runs, key=lambda r: (r["valid_acc"], -r["steps"]))


def sweep_lrs(model_name: str, config: RecallConfig = RecallConfig(), lrs=ZOOLOGY_LRS, seed: int = 0, log=print,
              device: str = "cpu") -> tuple[list[dict], dict]:
    """Zoology's lr sweep: ``model_name`` at each of ``lrs`` on the same data -> (every run, :func:`best_run`)."""
    data = recall_data(config, seed)
    runs = [run_recall(model_name, replace(config, lr=lr), seed, log, data, device) for lr in lrs]
    return runs, best_run(runs)
