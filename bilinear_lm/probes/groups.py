"""Small permutation groups (S3, A4, A5, S5) for permutation word problems.

A permutation of ``n`` points is a tuple ``p`` with ``p[i]`` the image of ``i``. Composition is
``compose(p, q) = p o q`` (apply ``q`` first): ``(p o q)[i] = p[q[i]]``.
Elements are listed in lexicographic order of their tuples (``itertools.permutations`` order), so
element index 0 is always the identity.
"""
from __future__ import annotations

from itertools import permutations

GROUPS = ("S3", "A4", "A5", "S5")


def compose(p: tuple[int, ...], q: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(p[i] for i in q)


def is_even(p: tuple[int, ...]) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


def cycle(n: int, *points: int) -> tuple[int, ...]:
    """The cycle (points[0] points[1] ... points[-1]) as a permutation of range(n)."""
    p = list(range(n))
    for a, b in zip(points, points[1:] + points[:1]):
        p[a] = b
    return tuple(p)


def parse_group(name: str) -> tuple[str, int]:
    key = str(name).upper()
    if key not in GROUPS:
        raise ValueError(f"unknown group {name!r}; choose one of {list(GROUPS)}")
    return key[0], int(key[1:])


def elements(name: str) -> list[tuple[int, ...]]:
    kind, n = parse_group(name)
    perms = list(permutations(range(n)))
    return perms if kind == "S" else [p for p in perms if is_even(p)]


def generators(name: str) -> list[tuple[int, ...]]:
    """A standard generating pair.

    S_n: the transposition (0 1) and the n-cycle (0 1 ... n-1).
    A_n: the 3-cycle (0 1 2) and (0 1 ... n-1) for odd n, (1 2 ... n-1) for even n.
    """
    kind, n = parse_group(name)
    if kind == "S":
        return [cycle(n, 0, 1), cycle(n, *range(n))]
    return [cycle(n, 0, 1, 2), cycle(n, *range(n)) if n % 2 == 1 else cycle(n, *range(1, n))]
