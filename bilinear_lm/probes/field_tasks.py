"""The field's formal-language tasks (Grazzi et al., ICLR 2025, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues", after Beck et al.'s xLSTM setup; code: adankow/unlocking_state_tracking,
``xlstm/experiments/data/formal_language/tasks/``): one answer per sequence, read at the last input position.

A length ``L`` counts the answer, as theirs does; the model reads the ``L - 1`` (parity) or ``L - 2`` (arithmetic:
the expression and ``=``) tokens before it. Labels are -100 but at the last position (``IGNORE``: no loss, not
scored). Modulus 5, classes: the answer's values. Tokens: digits 0-4, then ``+ - * ( ) =`` (both arithmetic tasks
share the vocabulary).

- ``field_parity``: ``L - 1`` uniform bits (tokens 0, 1); the answer is the number of 1s mod 2.
- ``field_modular_arithmetic`` ("without brackets"): ``d o d o ... d =`` with digits 0-4 and operators ``+ - *``
  uniform, ``*`` binding tighter than ``+`` and ``-`` (which associate to the left), mod 5 (Python's ``%``); ``L``
  odd (an even one is taken as ``L - 1``).
- ``field_modular_arithmetic_brackets``: ``gen(L - 3) =`` with ``gen(n)``: ``d`` (n = 1), ``-d`` (2), ``(d)`` (3),
  ``(-d)`` (4), else ``( gen(a) o gen(n - a - 3) )`` with ``a`` uniform in ``1 .. n - 4`` and ``o`` uniform in
  ``+ - *`` (their generator since 2025-03-15: multiplication included); ``L >= 5``.

Where this differs from their code: a batch is one length (theirs mixes lengths, padded to 256), so no padding
enters any model; their masked answer slot and padding tokens are not fed at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

IGNORE = -100  # a position without a label (no loss, not scored)
M = 5  # the modulus of both arithmetic tasks
DIGITS = tuple(range(M))
PLUS, MINUS, TIMES, OPEN, CLOSE, EQUALS = range(M, M + 6)  # token ids after the digits
SYMBOLS = [str(d) for d in DIGITS] + ["+", "-", "*", "(", ")", "="]


def _choice(n: int, generator: torch.Generator) -> int:
    return int(torch.randint(n, (1,), generator=generator))


def _parity(length: int, generator: torch.Generator) -> tuple[list[int], int]:
    bits = torch.randint(2, (length - 1,), generator=generator).tolist()
    return bits, sum(bits) % 2


def _expression_value(tokens: list[int]) -> int:
    """The value mod 5 of ``tokens`` (digits, ``+ - *``, brackets, unary minus before a digit), ``*`` binding
    tighter than ``+`` and ``-``: a recursive-descent evaluator, the reference the generators are tested against."""
    position = 0

    def term() -> int:
        nonlocal position
        value = factor()
        while position < len(tokens) and tokens[position] == TIMES:
            position += 1
            value = value * factor() % M
        return value

    def factor() -> int:
        nonlocal position
        token = tokens[position]
        position += 1
        if token == MINUS:
            return -factor() % M
        if token == OPEN:
            value = expression()
            position += 1  # the closing bracket
            return value
        return token

    def expression() -> int:
        nonlocal position
        value = term()
        while position < len(tokens) and tokens[position] in (PLUS, MINUS):
            op = tokens[position]
            position += 1
            value = (value + term()) % M if op == PLUS else (value - term()) % M
        return value

    return expression()


def _arithmetic(length: int, generator: torch.Generator) -> tuple[list[int], int]:
    length -= 1 - length % 2  # odd: d o d ... d = answer
    n = max(length - 2, 1)
    tokens = [_choice(M, generator) if i % 2 == 0 else PLUS + _choice(3, generator) for i in range(n)]
    return tokens + [EQUALS], _expression_value(tokens)


def _bracketed(n: int, generator: torch.Generator) -> list[int]:
    digit = _choice(M, generator)
    if n <= 4:
        return {1: [digit], 2: [MINUS, digit], 3: [OPEN, digit, CLOSE], 4: [OPEN, MINUS, digit, CLOSE]}[n]
    a = 1 + _choice(n - 4, generator)
    op = PLUS + _choice(3, generator)
    return [OPEN, *_bracketed(a, generator), op, *_bracketed(n - a - 3, generator), CLOSE]


def _arithmetic_brackets(length: int, generator: torch.Generator) -> tuple[list[int], int]:
    tokens = _bracketed(max(length, 5) - 3, generator)
    return tokens + [EQUALS], _expression_value(tokens)


@dataclass
class FieldTask:
    """A task of the field's protocol, used as :class:`~.tasks.Task` is (``sample``, ``vocab_size``,
    ``num_classes``, ``chance``), but with one label per sequence, at its last position, and no automaton."""

    name: str
    example: Callable[[int, torch.Generator], tuple[list[int], int]]
    vocab_size: int
    num_classes: int
    params: dict = field(default_factory=dict)
    automaton = None  # no automaton: nothing for the state-consistency loss to read

    @property
    def chance(self) -> float:
        return 1.0 / self.num_classes

    def sample(self, batch: int, length: int, generator: torch.Generator | None = None):
        """``batch`` sequences of the field's length ``length`` (the answer counted) -> ``(tokens [B, T], labels
        [B, T])``: the labels ``IGNORE`` but at the last position, the answer."""
        if batch < 1 or length < 3:
            raise ValueError(f"{self.name}: batch must be >= 1 and length >= 3 (the answer counted), got "
                             f"batch={batch}, length={length}")
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        rows, answers = zip(*(self.example(length, generator) for _ in range(batch)))
        width = {len(r) for r in rows}
        if len(width) != 1:  # every generator gives one input length per sequence length
            raise AssertionError(f"{self.name}: rows of lengths {sorted(width)} at length {length}")
        tokens = torch.tensor(rows, dtype=torch.long)
        labels = torch.full_like(tokens, IGNORE)
        labels[:, -1] = torch.tensor(answers)
        return tokens, labels


FIELD_TASKS = {
    "field_parity": lambda: FieldTask("field_parity", _parity, 2, 2),
    "field_modular_arithmetic": lambda: FieldTask("field_modular_arithmetic", _arithmetic, len(SYMBOLS), M, {"m": M}),
    "field_modular_arithmetic_brackets": lambda: FieldTask("field_modular_arithmetic_brackets", _arithmetic_brackets,
                                                           len(SYMBOLS), M, {"m": M}),
}
