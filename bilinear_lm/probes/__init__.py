"""State-tracking probes: deterministic automata + symbol samplers (generators only, no training).

    from bilinear_lm.probes import make_task
    task = make_task("permutation_S5")
    tokens, labels = task.sample(batch=64, length=10, generator=torch.Generator().manual_seed(0))

Training and length-generalization evaluation live in ``eval/state_tracking.py``.
"""
from .automata import Automaton, load_automaton
from .tasks import (
    TASK_NAMES,
    Task,
    automaton_task,
    cycle_navigation,
    make_task,
    modular_addition,
    modular_arithmetic,
    parity,
    permutation,
    random_fsm,
)

__all__ = [
    "Automaton", "load_automaton", "Task", "TASK_NAMES", "make_task", "parity", "modular_addition",
    "modular_arithmetic", "random_fsm", "cycle_navigation", "permutation", "automaton_task",
]
