"""Offline lm-eval task YAMLs and their ``!function`` utils, shipped as package data.

``bilinear_lm.evaluation.harness.TASKS_DIR`` is this folder: pass it to ``lm_eval --include_path``.
"""
