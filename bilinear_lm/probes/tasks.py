"""State-tracking tasks: a deterministic automaton plus a symbol sampler.

Every task makes labels the same way: ``labels = task.automaton.run(tokens)`` (the automaton's
output after each prefix), so a task is fully specified by its automaton and its sampler.

    task = make_task("modular_addition", m=5)
    tokens, labels = task.sample(64, 10, generator=torch.Generator().manual_seed(0))
    task.vocab_size, task.num_classes   # input symbols, output classes

Tasks (``m`` in brackets is the default)
- ``parity``: bits; label = number of 1s mod 2.
- ``modular_addition`` [m=5]: symbols 0..m-1; label = running sum mod m.
- ``modular_arithmetic`` [m=5]: alternating ``number op number op ...`` (tokens 0..m-1 are numbers,
  m, m+1, m+2 are ``+ - *``), evaluated strictly left to right: ``((n1 op1 n2) op2 n3) ...`` mod m.
- ``modular_arithmetic_precedence`` [m=5]: same sequences, evaluated with the usual precedence
  (``*`` binds tighter than ``+``/``-``, which associate to the left), as in the Chomsky-hierarchy
  benchmark (Deletang et al., 2023, "modular arithmetic without brackets"). Regular: the state is
  (sum of finished terms S, current signed product term P, pending operator); value = S + P mod m.
- For both arithmetic tasks the label at every position is the value mod m of the longest prefix
  that ends in a number (so at an operator position it repeats the previous label). A symbol in
  the wrong slot (number after number, operator after operator) leaves the state unchanged; the
  sampler never produces one.
- ``random_fsm`` [m=10]: m states, ``num_symbols`` symbols (default m), transition table drawn
  uniformly from ``torch.Generator().manual_seed(fsm_seed)``; start state 0; label = state.
- ``cycle_navigation`` [m=5]: symbols 0 = stay, 1 = +1, 2 = -1 on a cycle of length m, start 0;
  label = position (Deletang et al.).
- ``permutation_S3``, ``permutation_A4``, ``permutation_A5``, ``permutation_S5``: word problems;
  ``symbols="elements"`` (every group element is a symbol) or ``"generators"`` (a generating
  pair, see ``groups.generators``); label = index of the running product
  ``x_t o ... o x_1`` in the lexicographic element list (``groups.elements``).
- ``automaton``: any automaton from a JSON file (``path=...``, schema in ``load_automaton``).
- ``field_parity``, ``field_modular_arithmetic``, ``field_modular_arithmetic_brackets``: the field's formal-language
  tasks, one label per sequence (``field_tasks.py``; the last needs a stack: no automaton).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import groups as G
from .automata import Automaton, load_automaton
from .field_tasks import FIELD_TASKS, FieldTask

Sampler = Callable[[int, int, "torch.Generator | None"], torch.Tensor]


def uniform_sampler(num_symbols: int) -> Sampler:
    def sample(batch: int, length: int, generator=None) -> torch.Tensor:
        return torch.randint(num_symbols, (batch, length), generator=generator)
    return sample


def weighted_sampler(probs: torch.Tensor) -> Sampler:
    probs = torch.as_tensor(probs, dtype=torch.float64)

    def sample(batch: int, length: int, generator=None) -> torch.Tensor:
        if length == 0:
            return torch.zeros(batch, 0, dtype=torch.long)
        return torch.multinomial(probs.expand(batch, -1), length, replacement=True, generator=generator)
    return sample


def alternating_sampler(m: int, num_ops: int = 3) -> Sampler:
    """number, op, number, op, ... with numbers 0..m-1 and ops m..m+num_ops-1, all uniform."""
    def sample(batch: int, length: int, generator=None) -> torch.Tensor:
        nums = torch.randint(m, (batch, length), generator=generator)
        ops = m + torch.randint(num_ops, (batch, length), generator=generator)
        is_op = (torch.arange(length) % 2 == 1).expand(batch, -1)
        return torch.where(is_op, ops, nums)
    return sample


@dataclass
class Task:
    name: str
    automaton: Automaton
    sampler: Sampler
    params: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.automaton.num_symbols

    @property
    def num_classes(self) -> int:
        return self.automaton.num_classes

    @property
    def chance(self) -> float:
        """Uniform-guess accuracy 1/num_classes (used for chance-normalized accuracy)."""
        return 1.0 / self.num_classes

    def labels(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.automaton.run(tokens)

    def sample(self, batch: int, length: int, generator: torch.Generator | None = None):
        """-> (tokens LongTensor[B, T], labels LongTensor[B, T]); labels[:, t] = output after tokens[:, :t+1]."""
        if batch < 1 or length < 1:
            raise ValueError(f"batch and length must be >= 1, got batch={batch}, length={length}")
        tokens = self.sampler(batch, length, generator)
        return tokens, self.labels(tokens)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, vocab_size={self.vocab_size}, num_classes={self.num_classes}, params={self.params})"


def _check_m(m: int, lo: int, task: str) -> int:
    if not isinstance(m, int) or isinstance(m, bool) or m < lo:
        raise ValueError(f"{task}: m must be an integer >= {lo}, got {m!r}")
    return m


# ---------------------------------------------------------------------- constructors
def modular_addition(m: int = 5) -> Task:
    m = _check_m(m, 2, "modular_addition")
    s, q = torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij")
    auto = Automaton((q + s) % m, start=0, name=f"modular_addition_m{m}")
    return Task("modular_addition", auto, uniform_sampler(m), {"m": m})


def parity() -> Task:
    t = modular_addition(2)
    t.automaton.name = "parity"
    return Task("parity", t.automaton, t.sampler, {"m": 2})


OPS = ("+", "-", "*")


def _apply(op: int, a: int, b: int, m: int) -> int:
    return (a + b) % m if op == 0 else (a - b) % m if op == 1 else (a * b) % m


def modular_arithmetic(m: int = 5, precedence: bool = False) -> Task:
    task = "modular_arithmetic_precedence" if precedence else "modular_arithmetic"
    m = _check_m(m, 2, task)
    S = m + 3  # symbols: numbers 0..m-1, then + - *
    if not precedence:
        # states: N(v) = v (after a number), P(v, op) = m + 3v + op (after an operator)
        Q = 4 * m
        delta = torch.empty(S, Q, dtype=torch.long)
        outputs = torch.empty(Q, dtype=torch.long)
        for v in range(m):
            N = v
            outputs[N] = v
            for n in range(m):
                delta[n, N] = N                      # number after number: ignored
            for op in range(3):
                delta[m + op, N] = m + 3 * v + op
                P = m + 3 * v + op
                outputs[P] = v
                for n in range(m):
                    delta[n, P] = _apply(op, v, n, m)
                for op2 in range(3):
                    delta[m + op2, P] = P            # operator after operator: ignored
        start = m + 0                                # P(0, '+')
    else:
        # states: N(s, p) = s*m + p ; P(s, p, op) = m*m + 3*(s*m + p) + op; value = s + p
        Q = 4 * m * m
        delta = torch.empty(S, Q, dtype=torch.long)
        outputs = torch.empty(Q, dtype=torch.long)
        for s in range(m):
            for p in range(m):
                N = s * m + p
                outputs[N] = (s + p) % m
                for n in range(m):
                    delta[n, N] = N
                for op in range(3):
                    P = m * m + 3 * N + op
                    delta[m + op, N] = P
                    outputs[P] = (s + p) % m
                    for n in range(m):
                        if op == 0:
                            s2, p2 = (s + p) % m, n
                        elif op == 1:
                            s2, p2 = (s + p) % m, (-n) % m
                        else:
                            s2, p2 = s, (p * n) % m
                        delta[n, P] = s2 * m + p2
                    for op2 in range(3):
                        delta[m + op2, P] = P
        start = m * m + 0                            # P(0, 0, '+')
    symbols = [str(i) for i in range(m)] + list(OPS)
    auto = Automaton(delta, start=start, outputs=outputs, num_classes=m, symbol_names=symbols, name=f"{task}_m{m}")
    return Task(task, auto, alternating_sampler(m), {"m": m})


def random_fsm(m: int = 10, num_symbols: int | None = None, fsm_seed: int = 0) -> Task:
    m = _check_m(m, 2, "random_fsm")
    k = m if num_symbols is None else _check_m(num_symbols, 1, "random_fsm num_symbols")
    g = torch.Generator().manual_seed(int(fsm_seed))
    delta = torch.randint(m, (k, m), generator=g)
    auto = Automaton(delta, start=0, name=f"random_fsm_m{m}_k{k}_seed{fsm_seed}")
    return Task("random_fsm", auto, uniform_sampler(k), {"m": m, "num_symbols": k, "fsm_seed": int(fsm_seed)})


def cycle_navigation(m: int = 5) -> Task:
    m = _check_m(m, 2, "cycle_navigation")
    q = torch.arange(m)
    delta = torch.stack([q, (q + 1) % m, (q - 1) % m])
    auto = Automaton(delta, start=0, symbol_names=["stay", "+1", "-1"], name=f"cycle_navigation_m{m}")
    return Task("cycle_navigation", auto, uniform_sampler(3), {"m": m})


def permutation(group: str = "S5", symbols: str = "elements") -> Task:
    kind, n = G.parse_group(group)
    gname = f"{kind}{n}"
    if symbols not in ("elements", "generators"):
        raise ValueError(f"permutation: symbols must be 'elements' or 'generators', got {symbols!r}")
    elems = G.elements(gname)
    index = {p: i for i, p in enumerate(elems)}
    gens = elems if symbols == "elements" else G.generators(gname)
    delta = torch.tensor([[index[G.compose(x, g)] for g in elems] for x in gens], dtype=torch.long)
    auto = Automaton(delta, start=index[tuple(range(len(elems[0])))],
                     state_names=[str(p) for p in elems], symbol_names=[str(x) for x in gens],
                     name=f"permutation_{gname}_{symbols}")
    return Task(f"permutation_{gname}", auto, uniform_sampler(len(gens)), {"group": gname, "symbols": symbols})


def automaton_task(path) -> Task:
    auto = load_automaton(path)
    probs = auto.symbol_probs
    sampler = uniform_sampler(auto.num_symbols) if probs is None else weighted_sampler(probs)
    return Task("automaton", auto, sampler, {"path": str(path), "name": auto.name})


# ---------------------------------------------------------------------- registry
AUTOMATON_TASK_NAMES = (  # the tasks whose labels an automaton gives at every position
    "parity", "modular_addition", "modular_arithmetic", "modular_arithmetic_precedence", "random_fsm",
    "cycle_navigation", "permutation_S3", "permutation_A4", "permutation_A5", "permutation_S5", "automaton",
)
TASK_NAMES = (*AUTOMATON_TASK_NAMES, *FIELD_TASKS)
USES_M = {"modular_addition": 5, "modular_arithmetic": 5, "modular_arithmetic_precedence": 5,
          "random_fsm": 10, "cycle_navigation": 5}


def make_task(name: str, m: int | None = None, *, num_symbols: int | None = None, fsm_seed: int = 0,
              symbols: str = "elements", path=None) -> Task | FieldTask:
    """Build a task by name (see module docstring). ``m`` is ignored by tasks that have no modulus (the field's
    tasks fix theirs at 5)."""
    key = name
    if name.lower().startswith("permutation_"):
        key = "permutation_" + name.split("_", 1)[1].upper()
    if key not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r}; choose one of {list(TASK_NAMES)}")
    if key in USES_M:
        m = USES_M[key] if m is None else m
    if key in FIELD_TASKS:
        return FIELD_TASKS[key]()
    if key == "parity":
        return parity()
    if key == "modular_addition":
        return modular_addition(m)
    if key == "modular_arithmetic":
        return modular_arithmetic(m, precedence=False)
    if key == "modular_arithmetic_precedence":
        return modular_arithmetic(m, precedence=True)
    if key == "random_fsm":
        return random_fsm(m, num_symbols=num_symbols, fsm_seed=fsm_seed)
    if key == "cycle_navigation":
        return cycle_navigation(m)
    if key.startswith("permutation_"):
        return permutation(key.split("_", 1)[1], symbols=symbols)
    if path is None:
        raise ValueError("task 'automaton' needs a JSON file: pass path=... (CLI: --automaton-file FILE)")
    return automaton_task(path)
