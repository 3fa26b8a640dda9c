"""Moved to ``bilinear_lm.evaluation.harness``; kept until train.py imports ``run_lm_eval`` from there."""
from .evaluation.harness import TASKS_DIR, run_lm_eval

__all__ = ["TASKS_DIR", "run_lm_eval"]
