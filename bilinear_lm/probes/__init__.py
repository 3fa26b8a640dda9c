"""State-tracking probes: deterministic automata + symbol samplers, the probe models, training and evaluation.

    from bilinear_lm.probes import ProbeConfig, make_task, run_probe
    task = make_task("permutation_S5")
    tokens, labels = task.sample(batch=64, length=10, generator=torch.Generator().manual_seed(0))
    result = run_probe(make_task("parity"), "bilinear-diagonal", seed=0, config=ProbeConfig(steps=600))

Tasks: ``tasks.py`` / ``automata.py``; models: ``models.py``; training and evaluation: ``training.py``;
settings: ``config.py``; the MQAR recall probe: ``recall.py``. Tables and plots: ``report.py``; the command lines
(sweeps included): ``cli.py`` (``bilinear-probes``) and ``recall_cli.py`` (``bilinear-recall``).
"""
from .automata import Automaton, load_automaton
from .config import ProbeConfig
from .models import MODEL_NAMES, build_probe_model, class_logits, model_spec
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
from .training import check_state_consistency, evaluate, run_probe, state_consistency_loss

__all__ = [
    "Automaton", "load_automaton", "Task", "TASK_NAMES", "make_task", "parity", "modular_addition",
    "modular_arithmetic", "random_fsm", "cycle_navigation", "permutation", "automaton_task",
    "ProbeConfig", "MODEL_NAMES", "model_spec", "build_probe_model", "class_logits",
    "run_probe", "evaluate", "state_consistency_loss", "check_state_consistency",
]
