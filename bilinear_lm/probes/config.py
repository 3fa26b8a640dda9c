"""``ProbeConfig``: everything one probe run needs besides the task, the model name and the seed."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeConfig:
    """Training, evaluation and model-size settings of a probe run (the defaults are the paper's protocol).

    Training: per-position cross-entropy on lengths uniform in ``train_lengths`` (inclusive), batch
    ``batch_size``, Adam at ``lr`` (None: 3e-3 bilinear, 1e-3 baselines) with ``lr_schedule`` ("cosine": to 0
    over ``steps`` or ``max_seconds``, whichever ends first), gradient clipping at ``grad_clip`` (0 = off), plus
    ``state_consistency`` x the center loss on the recurrent state (bilinear models only, 0 = off).
    Selection and stopping: every ``eval_every`` steps on ``val_size`` sequences of ``val_length``; stop once
    validation accuracy has been perfect for ``patience`` steps. Test: ``test_size`` sequences at each of
    ``test_lengths``, evaluated ``eval_tokens`` tokens at a time.
    Models: ``hidden_size`` (every model), ``state_size`` / ``rank`` (None: state size, the number of task
    symbols for ``full``) / ``block_size`` / ``gate`` / ``write_channel`` (CP only: ``BilinearConfig.write_channel``)
    (bilinear), ``num_heads`` (transformers).
    """

    train_lengths: tuple[int, int] = (2, 10)
    test_lengths: tuple[int, ...] = (500,)
    val_length: int = 250
    val_size: int = 100
    test_size: int = 1000
    steps: int = 10000
    max_seconds: float | None = None
    patience: int = 2000
    eval_every: int = 200
    batch_size: int = 64
    lr: float | None = None
    lr_schedule: str = "cosine"
    grad_clip: float = 1.0
    state_consistency: float = 0.0
    eval_tokens: int = 8192
    hidden_size: int = 128
    state_size: int = 128
    rank: int | None = None
    block_size: int = 2
    gate: bool = False
    write_channel: bool = False
    num_heads: int = 4
    verbose: bool = False

    def __post_init__(self):
        def bad(field: str, requirement: str) -> ValueError:
            return ValueError(f"ProbeConfig.{field} must be {requirement}, got {getattr(self, field)!r}")

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
        for field in ("val_length", "val_size", "test_size", "steps", "patience", "eval_every", "batch_size",
                      "eval_tokens", "hidden_size", "state_size", "block_size", "num_heads"):
            if not is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "an integer >= 1")
        if self.rank is not None and (not is_int(self.rank) or self.rank < 1):
            raise bad("rank", "None (the default rank) or an integer >= 1")
        for field in ("lr", "max_seconds"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise bad(field, "None or a finite number > 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise bad("lr_schedule", "'constant' or 'cosine'")
        if not (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise bad("grad_clip", "a finite number >= 0 (0 = off)")
        w = self.state_consistency
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise bad("state_consistency", "a finite weight >= 0 (0 = off)")

    @property
    def max_length(self) -> int:
        """The longest sequence the model sees (validation or test): transformers size their positions to it."""
        return max(self.test_lengths + (self.val_length,))
