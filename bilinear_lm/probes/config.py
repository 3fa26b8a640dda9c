"""``ProbeConfig``: everything one probe run needs besides the task, the model name and the seed.

Settings are declared with :func:`option` (default and command-line help in one place): the CLIs
(``bilinear_lm.probes.cli``) make one flag per field, so a new field is a new flag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

LR_SCHEDULES = ("constant", "cosine")


def option(default, help: str, **flag):
    """A config field with its command-line help (``metadata``; ``flag``: further argparse keywords such as
    ``choices`` or ``metavar``)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ProbeConfig:
    """Training, evaluation and model-size settings of a probe run (the defaults are the paper's protocol).

    Training: per-position cross-entropy on lengths uniform in ``train_lengths``, Adam with a schedule and
    gradient clipping, plus ``state_consistency`` x the center loss on the recurrent state (bilinear models only).
    Selection and stopping: every ``eval_every`` steps on a validation set; stop once validation accuracy has been
    perfect for ``patience`` steps. Test: ``test_size`` sequences at each of ``test_lengths``. Each field's help
    says what it sets.
    """

    train_lengths: tuple[int, int] = option((2, 10), "training lengths, drawn uniformly from LO..HI (inclusive)")
    test_lengths: tuple[int, ...] = option((500,), "test lengths")
    val_length: int = option(250, "validation sequence length (model selection and stopping)")
    val_size: int = option(100, "validation sequences")
    test_size: int = option(1000, "test sequences per test length")
    steps: int = option(10000, "maximum training steps")
    max_seconds: float | None = option(None, "optional wall-clock budget per run")
    patience: int = option(2000, "stop after validation accuracy is perfect this many steps")
    eval_every: int = option(200, "validate every this many steps")
    batch_size: int = option(64, "training batch size")
    lr: float | None = option(None, "Adam lr (default 3e-3 bilinear, 1e-3 baselines)")
    lr_schedule: str = option("cosine", "cosine: decay to 0 over the steps or max seconds, whichever ends first",
                              choices=LR_SCHEDULES)
    grad_clip: float = option(1.0, "max grad norm (0 = off)")
    state_consistency: float = option(
        0.0, "bilinear: add WEIGHT x a center loss pulling together the recurrent states (and memory read-outs) of "
             "prefixes with the same label (for tasks whose label is the automaton state; 0 = off, the paper's "
             "protocol)", metavar="WEIGHT")
    eval_tokens: int = option(8192, "tokens per evaluation chunk (memory bound)")
    hidden_size: int = option(128, "model width")
    state_size: int = option(128, "bilinear state size")
    rank: int | None = option(None, "bilinear rank (default: state size; number of task symbols for full)")
    block_size: int = option(2, "bilinear block_diagonal block size")
    gate: bool = option(False, "bilinear: multiply the readout by the LM's output gate silu(W_g x) (default: the "
                               "paper's linear readout of the normalized state)")
    memory_heads: int = option(0, "bilinear: memory heads (a gated delta rule, BilinearConfig.memory_heads) beside "
                                  "each layer's tracking head (0 = none)")
    memory_size: int = option(32, "bilinear: the memory heads' key and value size")
    num_heads: int = option(4, "attention heads (transformer-N, and the attention layers of hybrid-N)")
    attention_window: int | None = option(None, "hybrid-N: its attention layers see only this many positions "
                                                "(sliding-window attention; default: full attention)")
    attention_rope: bool = option(True, "hybrid-N: rotary embeddings in its attention layers (--no-attention-rope: "
                                        "none, BilinearConfig.use_rope=False)")
    verbose: bool = option(False, "log every validation")

    def __post_init__(self):
        def bad(name: str, requirement: str) -> ValueError:
            return ValueError(f"ProbeConfig.{name} must be {requirement}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        lengths = tuple(self.train_lengths) if isinstance(self.train_lengths, (tuple, list)) else ()
        if len(lengths) != 2 or not all(is_int(x) for x in lengths) or not 1 <= lengths[0] <= lengths[1]:
            raise bad("train_lengths", "a pair (lo, hi) of integers with 1 <= lo <= hi, e.g. (2, 10)")
        object.__setattr__(self, "train_lengths", lengths)
        tests = tuple(self.test_lengths) if isinstance(self.test_lengths, (tuple, list)) else ()
        if not tests or not all(is_int(x) and x >= 1 for x in tests):
            raise bad("test_lengths", "a non-empty sequence of integers >= 1, e.g. (500,)")
        object.__setattr__(self, "test_lengths", tests)
        for name in ("val_length", "val_size", "test_size", "steps", "patience", "eval_every", "batch_size",
                      "eval_tokens", "hidden_size", "state_size", "block_size", "num_heads", "memory_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if not is_int(self.memory_heads) or self.memory_heads < 0:
            raise bad("memory_heads", "an integer >= 0 (0 = none)")
        if self.rank is not None and (not is_int(self.rank) or self.rank < 1):
            raise bad("rank", "None (the default rank) or an integer >= 1")
        if self.attention_window is not None and (not is_int(self.attention_window) or self.attention_window < 1):
            raise bad("attention_window", "None (full attention) or an integer >= 1")
        for name in ("lr", "max_seconds"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise bad(name, "None or a finite number > 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise bad("lr_schedule", " or ".join(map(repr, LR_SCHEDULES)))
        if not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise bad("grad_clip", "a finite number >= 0 (0 = off)")
        w = self.state_consistency
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise bad("state_consistency", "a finite weight >= 0 (0 = off)")

    @property
    def max_length(self) -> int:
        """The longest sequence the model sees (validation or test): transformers size their positions to it."""
        return max(self.test_lengths + (self.val_length,))
