"""Evaluation scripts (``python eval/perplexity.py``), installed as ``bilinear_lm.eval``."""
