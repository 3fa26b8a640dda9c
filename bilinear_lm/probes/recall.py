"""Multi-query associative recall (MQAR, as in the Zoology benchmark: Arora et al. 2023, "Zoology: Measuring and
Improving Recall in Efficient Language Models"): :func:`mqar` makes the data, :func:`run_recall` trains and scores.

A sequence starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys from the first half of the vocabulary,
values from the second, keys distinct), then every key is queried once at a random later position; the other
positions hold token 0. The label at a query is its key's value; every other position is ignored (-100). A model
must store all pairs in its state and read any one back: attention does this by lookup, and a fixed-size
recurrent state only as far as it can hold ``num_pairs`` associations. A purely multiplicative state (``h_t =
A(x_t) h_{t-1}``, no write term) is expected to do poorly here.

For training, ``RecallConfig.dense_fraction`` makes a fraction of the sequences *dense* (a query at every position
after the pairs): with half of them dense, Llama learns the task at length 64 with 4 pairs within 1,500 steps, where
plain sequences left it at ``1 / num_pairs`` after 8,000 (docs/probes.md). The test sequences are
always plain.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..baselines import build_model
from ..utils import eval_mode
from .config import option
from .training import default_lr

IGNORE = -100
RECALL_MODELS = ("bilinear", "bilinear-conv", "llama", "lstm")


def mqar(num_examples: int, seq_len: int, num_pairs: int, vocab_size: int, generator=None, dense: float = 0.0):
    """``(tokens, labels)``, both ``[num_examples, seq_len]`` long tensors (see the module docstring). ``dense``: the
    probability that a sequence is *dense*: every position after its pairs is a query (its keys' own queries as in
    a plain sequence, then a key drawn uniformly from its pairs at each other position), so that it has ``seq_len -
    2 * num_pairs`` answers instead of ``num_pairs``: the same task with more answers per sequence (a training
    option, ``RecallConfig.dense_fraction``; with ``dense=0`` the generator draws exactly what it drew before)."""
    half = vocab_size // 2
    if num_pairs < 1 or 3 * num_pairs > seq_len:
        raise ValueError(f"mqar: need 1 <= num_pairs and 3 * num_pairs <= seq_len (pairs plus one query each), got "
                         f"num_pairs={num_pairs}, seq_len={seq_len}")
    if half - 1 < num_pairs:
        raise ValueError(f"mqar: vocab_size {vocab_size} has only {half - 1} keys for {num_pairs} distinct keys; "
                         "raise vocab_size")
    keys = torch.rand(num_examples, half - 1, generator=generator).argsort(dim=1)[:, :num_pairs] + 1
    values = torch.randint(half, vocab_size, (num_examples, num_pairs), generator=generator)
    tokens = torch.zeros(num_examples, seq_len, dtype=torch.long)
    labels = torch.full((num_examples, seq_len), IGNORE, dtype=torch.long)
    tokens[:, 0:2 * num_pairs:2], tokens[:, 1:2 * num_pairs:2] = keys, values
    # Query slots: num_pairs distinct positions after the pairs; key i is asked at its slot in a random order.
    slots = torch.rand(num_examples, seq_len - 2 * num_pairs, generator=generator).argsort(dim=1)[:, :num_pairs]
    slots = slots + 2 * num_pairs
    order = torch.rand(num_examples, num_pairs, generator=generator).argsort(dim=1)
    tokens.scatter_(1, slots, keys.gather(1, order))
    labels.scatter_(1, slots, values.gather(1, order))
    if dense > 0:
        rows = torch.rand(num_examples, 1, generator=generator) < dense
        free = (labels[:, 2 * num_pairs:] == IGNORE) & rows
        pick = torch.randint(num_pairs, free.shape, generator=generator)
        rest_x, rest_y = tokens[:, 2 * num_pairs:], labels[:, 2 * num_pairs:]
        rest_x[free], rest_y[free] = keys.gather(1, pick)[free], values.gather(1, pick)[free]
    return tokens, labels


@dataclass(frozen=True)
class RecallConfig:
    """One MQAR run: data (every training batch is freshly sampled, so a model cannot pass by memorizing a fixed
    training set), training (Adam, linear warmup then cosine decay) and the model's size (bilinear ``num_heads`` x
    ``state_size``, rank = state size; the baselines are built at the same width and depth, Llama with ``num_heads``
    heads).
    Each field's help says what it sets."""

    vocab_size: int = option(1024, "vocabulary: keys from the first half, values from the second")
    seq_len: int = option(128, "sequence length")
    num_pairs: int = option(8, "key-value pairs per sequence")
    test_size: int = option(500, "held-out test sequences")
    steps: int = option(1500, "training steps")
    batch_size: int = option(64, "training batch size")
    lr: float | None = option(None, "Adam lr (default 3e-3 for bilinear models, 1e-3 for the baselines)")
    warmup_steps: int = option(0, "linear lr warmup steps, then cosine decay to 0 at the last step")
    dense_fraction: float = option(0.0, "fraction of training sequences with a query at every position after the "
                                   "pairs (keys repeat: seq_len - 2 * num_pairs answers instead of num_pairs); the "
                                   "test sequences stay plain (one query per key)")
    hidden_size: int = option(128, "model width")
    num_layers: int = option(2, "model depth")
    num_heads: int = option(4, "bilinear and Llama heads")
    state_size: int = option(32, "bilinear state size per head")
    extra: dict = field(default_factory=dict)  # further BilinearConfig keys for the bilinear models

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "num_pairs", "test_size", "steps", "batch_size",
                     "hidden_size", "num_layers", "num_heads", "state_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RecallConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or \
                not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"RecallConfig.warmup_steps must be an integer in [0, steps), got {self.warmup_steps!r}")
        if isinstance(self.dense_fraction, bool) or not isinstance(self.dense_fraction, (int, float)) or \
                not 0 <= self.dense_fraction <= 1:
            raise ValueError(f"RecallConfig.dense_fraction must be a number in [0, 1], got {self.dense_fraction!r}")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"RecallConfig.lr must be None or a finite number > 0, got {self.lr!r}")


def recall_model(name: str, config: RecallConfig):
    """A causal LM for MQAR: ``bilinear`` (pure), ``bilinear-conv`` (``conv_width=4``), ``llama`` or ``lstm``, all
    ``num_layers`` deep and
    ``hidden_size`` wide, with untied input and output embeddings (as Llama and the LSTM here: tied, a 2-layer
    attention model of the bilinear stack stayed at ``1 / pairs``, 0.260, where untied it reached 0.981)."""
    c = config
    if name in ("bilinear", "bilinear-conv"):
        cfg = dict(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_heads=c.num_heads,
                   state_size=c.state_size, rank=c.state_size, conv_width=4 if name == "bilinear-conv" else 0,
                   tie_word_embeddings=False, **c.extra)
        return build_model("bilinear", cfg, c.vocab_size, match_bilinear=False)
    if name == "llama":
        cfg = dict(hidden_size=c.hidden_size, intermediate_size=4 * c.hidden_size, num_hidden_layers=c.num_layers,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
                   max_position_embeddings=c.seq_len, use_cache=False)
        return build_model("llama", cfg, c.vocab_size, match_bilinear=False)
    if name == "lstm":
        return build_model("lstm", dict(hidden_size=c.hidden_size, num_layers=c.num_layers), c.vocab_size,
                           match_bilinear=False)
    raise ValueError(f"unknown recall model {name!r}; choose one of {RECALL_MODELS}")


def lr_factor(step: int, config: RecallConfig) -> float:
    """The lr multiplier at ``step``: linear warmup over ``warmup_steps``, then cosine decay to 0 at ``steps``."""
    w = config.warmup_steps
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * min((step - w) / (config.steps - w), 1)))


@torch.no_grad()
def query_accuracy(model, tokens, labels, batch_size: int = 100) -> float:
    """Fraction of query positions (``labels != -100``) whose argmax logit is the value."""
    correct = total = 0
    with eval_mode(model):
        for i in range(0, len(tokens), batch_size):
            x, y = tokens[i:i + batch_size], labels[i:i + batch_size]
            logits = model(input_ids=x).logits
            asked = y != IGNORE
            correct += int((logits.argmax(-1)[asked] == y[asked]).sum())
            total += int(asked.sum())
    return correct / total


def held_out_set(config: RecallConfig, seed: int = 0):
    """The held-out sequences of a run: plain MQAR (one query per key) whatever the training options."""
    c = config
    return mqar(c.test_size, c.seq_len, c.num_pairs, c.vocab_size, torch.Generator().manual_seed(10**6 + seed))


def train_batch(config: RecallConfig, generator):
    """One freshly sampled training batch (a ``dense_fraction`` of its sequences dense, see :func:`mqar`)."""
    c = config
    return mqar(c.batch_size, c.seq_len, c.num_pairs, c.vocab_size, generator, dense=c.dense_fraction)


def run_recall(model_name: str, config: RecallConfig = RecallConfig(), seed: int = 0, log=print,
               log_every: int = 0) -> dict:
    """Train ``model_name`` on MQAR for ``config.steps`` steps -> result dict with the test query accuracy; with
    ``log_every`` > 0, ``log`` the training loss every ``log_every`` steps."""
    c = config
    g = torch.Generator().manual_seed(seed)
    test_x, test_y = held_out_set(c, seed)
    torch.manual_seed(seed)
    model = recall_model(model_name, c).train()
    lr = c.lr if c.lr is not None else default_lr(model_name)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, c))
    t0, loss = time.time(), float("nan")
    for step in range(c.steps):
        x, y = train_batch(c, g)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if log_every and (step + 1) % log_every == 0:
            log(f"{model_name} step {step + 1}/{c.steps}: training loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    result = {"model": model_name, "seed": seed, **{k: v for k, v in asdict(c).items() if k != "extra"}, "lr": lr,
              "extra": dict(c.extra), "config": asdict(c), "num_params": sum(p.numel() for p in model.parameters()),
              "train_loss": round(loss.item(), 4), "seconds": round(seconds, 1),
              "test_acc": query_accuracy(model, test_x, test_y)}
    log(f"mqar pairs={c.num_pairs} len={c.seq_len} {model_name} seed {seed}: test acc {result['test_acc']:.3f} "
        f"(last train loss {result['train_loss']}), {seconds:.0f}s")
    return result
