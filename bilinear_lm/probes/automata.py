"""Deterministic finite automata (Moore machines) and their JSON format.

An :class:`Automaton` is the single source of truth for every state-tracking probe: a task is an
automaton plus a symbol sampler, and labels are always produced by :meth:`Automaton.run`.

Conventions
- States are ``0 .. num_states-1``; symbols are ``0 .. num_symbols-1`` (= token ids).
- ``delta[s, q]`` is the state reached from state ``q`` on symbol ``s`` (LongTensor [S, Q]).
- ``outputs[q]`` is the class label emitted in state ``q`` (LongTensor [Q]); the identity unless the
  task reports a function of the state (e.g. the value of an arithmetic expression).
- ``symbol_probs`` (float64 [S], summing to 1) are the sampling probabilities of the symbols, or None for
  uniform sampling.
- The label at position t is ``outputs[state after reading tokens[0..t]]`` (the start state itself
  is never labelled).
- :meth:`transition_matrices` returns one-hot matrices ``A[s]`` with ``A[s][q', q] = 1`` iff
  ``delta[s, q] = q'``, so that a bilinear RNN ``h_t = A(x_t) h_{t-1}`` with one-hot column state
  ``h_0 = e_start`` simulates the automaton exactly, and ``readout = one_hot(outputs)`` gives labels.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch


class Automaton:
    """A complete deterministic automaton with a state -> class output map."""

    def __init__(
        self,
        delta,
        start: int = 0,
        outputs=None,
        num_classes: int | None = None,
        state_names: Sequence[str] | None = None,
        symbol_names: Sequence[str] | None = None,
        class_names: Sequence[str] | None = None,
        name: str = "automaton",
        symbol_probs=None,
    ):
        delta = torch.as_tensor(delta, dtype=torch.long)
        if delta.dim() != 2 or delta.numel() == 0:
            raise ValueError(f"{name}: delta must be a non-empty [num_symbols, num_states] table, got shape {tuple(delta.shape)}")
        num_symbols, num_states = delta.shape
        if delta.min() < 0 or delta.max() >= num_states:
            raise ValueError(f"{name}: delta entries must be state ids in [0, {num_states}), got range "
                             f"[{int(delta.min())}, {int(delta.max())}]")
        if not 0 <= int(start) < num_states:
            raise ValueError(f"{name}: start state {start} is not in [0, {num_states})")
        outputs = torch.arange(num_states) if outputs is None else torch.as_tensor(outputs, dtype=torch.long)
        if outputs.shape != (num_states,):
            raise ValueError(f"{name}: outputs must have one class per state ({num_states}), got shape {tuple(outputs.shape)}")
        if outputs.min() < 0:
            raise ValueError(f"{name}: outputs must be non-negative class ids")
        n_cls = int(outputs.max()) + 1 if num_classes is None else int(num_classes)
        if int(outputs.max()) >= n_cls:
            raise ValueError(f"{name}: output class {int(outputs.max())} >= num_classes {n_cls}")
        if symbol_probs is not None:
            symbol_probs = torch.as_tensor(symbol_probs, dtype=torch.float64)
            if symbol_probs.shape != (num_symbols,):
                raise ValueError(f"{name}: symbol_probs must have one weight per symbol ({num_symbols}), got shape "
                                 f"{tuple(symbol_probs.shape)}")
            if not torch.isfinite(symbol_probs).all() or (symbol_probs < 0).any() or symbol_probs.sum() <= 0:
                raise ValueError(f"{name}: symbol_probs must be finite non-negative weights, not all zero, got "
                                 f"{symbol_probs.tolist()}")
            if abs(float(symbol_probs.sum()) - 1) > 1e-12:  # probabilities stay as given: to_dict round-trips exactly
                symbol_probs = symbol_probs / symbol_probs.sum()
        self.symbol_probs = symbol_probs
        self.delta = delta.contiguous()
        self.start = int(start)
        self.outputs = outputs.contiguous()
        self.num_symbols = int(num_symbols)
        self.num_states = int(num_states)
        self.num_classes = n_cls
        self.name = name
        self.state_names = list(state_names) if state_names is not None else [str(i) for i in range(num_states)]
        self.symbol_names = list(symbol_names) if symbol_names is not None else [str(i) for i in range(num_symbols)]
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(n_cls)]

    def __repr__(self) -> str:
        return (f"Automaton(name={self.name!r}, num_states={self.num_states}, num_symbols={self.num_symbols}, "
                f"num_classes={self.num_classes}, start={self.start})")

    # ------------------------------------------------------------------ running
    def run_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """States after each prefix: tokens LongTensor [B, T] -> LongTensor [B, T]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.num_symbols):
            raise ValueError(f"{self.name}: tokens must be symbol ids in [0, {self.num_symbols})")
        B, T = tokens.shape
        # flat index symbol * Q + state into the flattened delta table: one gather per position
        flat = self.delta.reshape(-1)
        state = torch.full((B,), self.start, dtype=torch.long)
        states = torch.empty(B, T, dtype=torch.long)
        offs = tokens * self.num_states
        for t in range(T):
            state = flat[offs[:, t] + state]
            states[:, t] = state
        return states

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """Class labels after each prefix: LongTensor [B, T]."""
        return self.outputs[self.run_states(tokens)]

    def transition_matrices(self, dtype=torch.float32) -> torch.Tensor:
        """One-hot transition matrices [num_symbols, num_states, num_states], A[s][q', q] = [delta[s,q] = q']."""
        S, Q = self.num_symbols, self.num_states
        A = torch.zeros(S, Q, Q, dtype=dtype)
        A[torch.arange(S).repeat_interleave(Q), self.delta.reshape(-1), torch.arange(Q).repeat(S)] = 1
        return A

    def output_matrix(self, dtype=torch.float32) -> torch.Tensor:
        """One-hot readout [num_classes, num_states]: class logits = R @ h for a one-hot state h."""
        R = torch.zeros(self.num_classes, self.num_states, dtype=dtype)
        R[self.outputs, torch.arange(self.num_states)] = 1
        return R

    def start_vector(self, dtype=torch.float32) -> torch.Tensor:
        h = torch.zeros(self.num_states, dtype=dtype)
        h[self.start] = 1
        return h

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "name": self.name,
            "states": self.state_names,
            "alphabet": self.symbol_names,
            "start": self.state_names[self.start],
            "transitions": {
                q: {s: self.state_names[int(self.delta[si, qi])] for si, s in enumerate(self.symbol_names)}
                for qi, q in enumerate(self.state_names)
            },
        }
        if not torch.equal(self.outputs, torch.arange(self.num_states)):
            d["outputs"] = {q: self.class_names[int(self.outputs[qi])] for qi, q in enumerate(self.state_names)}
        if self.symbol_probs is not None:
            d["symbol_probs"] = {s: float(p) for s, p in zip(self.symbol_names, self.symbol_probs)}
        return d

    def save_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, spec: Any, source: str = "automaton spec") -> "Automaton":
        """Build from the JSON schema documented in the README (see ``load_automaton``)."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"{source}: {msg}")

        if not isinstance(spec, dict):
            raise bad(f"top level must be a JSON object, got {type(spec).__name__}")
        known = {"name", "states", "alphabet", "start", "transitions", "outputs", "symbol_probs"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise bad(f"unknown key(s) {unknown}; allowed keys are {sorted(known)}")
        for key in ("states", "alphabet", "start", "transitions"):
            if key not in spec:
                raise bad(f"missing required key '{key}'")

        def name_list(key: str) -> list[str]:
            v = spec[key]
            if not isinstance(v, list) or not v:
                raise bad(f"'{key}' must be a non-empty list of names, got {v!r}")
            for x in v:
                if not isinstance(x, (str, int)) or isinstance(x, bool):
                    raise bad(f"'{key}' entries must be strings (or integers), got {x!r}")
            names = [str(x) for x in v]
            dup = sorted({x for x in names if names.count(x) > 1})
            if dup:
                raise bad(f"'{key}' has duplicate entries {dup}")
            return names

        states = name_list("states")
        alphabet = name_list("alphabet")
        q_index = {q: i for i, q in enumerate(states)}
        s_index = {s: i for i, s in enumerate(alphabet)}
        start = str(spec["start"])
        if start not in q_index:
            raise bad(f"start state {spec['start']!r} is not one of the states {states}")

        trans = spec["transitions"]
        delta = torch.full((len(alphabet), len(states)), -1, dtype=torch.long)
        if isinstance(trans, dict):
            extra = sorted(set(map(str, trans)) - set(states))
            if extra:
                raise bad(f"'transitions' has entries for unknown state(s) {extra}")
            for q in states:
                row = trans.get(q)
                if row is None:
                    raise bad(f"'transitions' has no entry for state {q!r} (every state needs a target for every symbol)")
                if not isinstance(row, dict):
                    raise bad(f"'transitions'[{q!r}] must be an object mapping symbol -> next state, got {row!r}")
                extra = sorted(set(map(str, row)) - set(alphabet))
                if extra:
                    raise bad(f"'transitions'[{q!r}] uses symbol(s) {extra} not in the alphabet {alphabet}")
                for s in alphabet:
                    if s not in row:
                        raise bad(f"'transitions'[{q!r}] is missing symbol {s!r} (the automaton must be complete)")
                    target = str(row[s])
                    if target not in q_index:
                        raise bad(f"'transitions'[{q!r}][{s!r}] = {row[s]!r} is not one of the states {states}")
                    delta[s_index[s], q_index[q]] = q_index[target]
        elif isinstance(trans, list):
            # list form: transitions[state_index][symbol_index] = next state name or index
            if len(trans) != len(states):
                raise bad(f"'transitions' list must have one row per state ({len(states)}), got {len(trans)}")
            for qi, row in enumerate(trans):
                if not isinstance(row, list) or len(row) != len(alphabet):
                    raise bad(f"'transitions'[{qi}] (state {states[qi]!r}) must be a list with one target per "
                              f"symbol ({len(alphabet)}), got {row!r}")
                for si, target in enumerate(row):
                    if isinstance(target, int) and not isinstance(target, bool):
                        if not 0 <= target < len(states):
                            raise bad(f"'transitions'[{qi}][{si}] = {target} is not a state index in [0, {len(states)})")
                        delta[si, qi] = target
                    elif str(target) in q_index:
                        delta[si, qi] = q_index[str(target)]
                    else:
                        raise bad(f"'transitions'[{qi}][{si}] = {target!r} is not one of the states {states}")
        else:
            raise bad(f"'transitions' must be an object {{state: {{symbol: next_state}}}} or a list of rows, "
                      f"got {type(trans).__name__}")

        outputs = None
        class_names = None
        if "outputs" in spec:
            out = spec["outputs"]
            if not isinstance(out, dict):
                raise bad(f"'outputs' must be an object mapping state -> class name, got {type(out).__name__}")
            missing = [q for q in states if q not in out]
            extra = sorted(set(map(str, out)) - set(states))
            if extra:
                raise bad(f"'outputs' has entries for unknown state(s) {extra}")
            if missing:
                raise bad(f"'outputs' is missing state(s) {missing} (give every state a class)")
            class_names = []
            for q in states:
                c = str(out[q])
                if c not in class_names:
                    class_names.append(c)
            outputs = [class_names.index(str(out[q])) for q in states]

        name = spec.get("name", "automaton")
        if not isinstance(name, str):
            raise bad(f"'name' must be a string, got {name!r}")
        probs = _parse_probs(spec["symbol_probs"], alphabet, bad) if "symbol_probs" in spec else None
        return cls(delta, start=q_index[start], outputs=outputs, state_names=states, symbol_names=alphabet,
                   class_names=class_names, name=name, symbol_probs=probs)


def _parse_probs(v, alphabet: list[str], bad) -> list[float]:
    """The JSON ``symbol_probs`` (object symbol -> weight, or list) as one weight per symbol of the alphabet."""
    if isinstance(v, dict):
        extra = sorted(set(map(str, v)) - set(alphabet))
        if extra:
            raise bad(f"'symbol_probs' uses symbol(s) {extra} not in the alphabet {alphabet}")
        vals = [v.get(s, 0.0) for s in alphabet]
    elif isinstance(v, list):
        if len(v) != len(alphabet):
            raise bad(f"'symbol_probs' list must have one weight per symbol ({len(alphabet)}), got {len(v)}")
        vals = v
    else:
        raise bad(f"'symbol_probs' must be an object symbol -> weight or a list, got {type(v).__name__}")
    for x in vals:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or x < 0 or x != x:
            raise bad(f"'symbol_probs' weights must be non-negative numbers, got {x!r}")
    if sum(vals) <= 0:
        raise bad("'symbol_probs' weights must not all be zero")
    return vals


def load_automaton(path) -> Automaton:
    """Load an automaton from a JSON file; malformed files raise ValueError naming the problem.

    Schema (see README)::

        {
          "name": "parity",                        # optional
          "states": ["even", "odd"],               # required, unique names
          "alphabet": ["0", "1"],                  # required, unique names; token id = list index
          "start": "even",                         # required
          "transitions": {                         # required, complete: every state x every symbol
            "even": {"0": "even", "1": "odd"},
            "odd":  {"0": "odd",  "1": "even"}
          },
          "outputs": {"even": "0", "odd": "1"},    # optional state -> class (default: class = state)
          "symbol_probs": {"0": 0.5, "1": 0.5}     # optional sampling weights (default uniform)
        }

    ``transitions`` may also be a list of rows, ``transitions[state_index][symbol_index]`` = next
    state name or index.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"automaton file {str(p)!r} does not exist")
    try:
        spec = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    return Automaton.from_dict(spec, source=str(p))
