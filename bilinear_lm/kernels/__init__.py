"""Compiled kernels (optional fast paths; the modeling code falls back to PyTorch without them)."""
