"""Evaluation of causal LMs: perplexity protocols over a whole text and lm-evaluation-harness on an in-memory model.

``perplexity.py``: streaming (recurrent state carried), strided and rolling perplexity, bits per byte, and the
``bilinear-perplexity`` CLI; ``harness.py``: ``run_lm_eval``, ``run_harness`` (train.py's ``--eval_lm_harness``:
OUTPUT_DIR/lm_harness.json) and ``TASKS_DIR``, the offline lm-eval tasks shipped in ``lm_eval_tasks/`` (pass it to
``lm_eval --include_path``).
"""
from .harness import TASKS_DIR, run_harness, run_lm_eval
from .perplexity import evaluate_text, rolling_perplexity, streaming_perplexity, strided_perplexity

__all__ = ["TASKS_DIR", "run_lm_eval", "run_harness", "evaluate_text", "rolling_perplexity", "streaming_perplexity",
           "strided_perplexity"]
