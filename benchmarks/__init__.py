"""Benchmark scripts (``python benchmarks/speed.py``), installed as ``bilinear_lm.benchmarks``."""
