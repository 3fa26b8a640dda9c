"""glibc's ``malloc`` while a model trains on CPU: freed memory kept for reuse (:func:`keep_freed_memory`), applied by
the model itself on its first training forward on CPU (:func:`keep_freed_memory_when_training`)."""

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger(__name__)
OPT_OUT_ENV = "BILINEAR_LM_KEEP_FREED_MEMORY"  # "0": the model leaves malloc as it is
_settled = False  # whether this process's first training forward on CPU has already decided


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse: no ``mmap`` for large blocks, no trimming of the heap.

    By default glibc returns the top of its heap to the system whenever 64 MiB or more of it is free, and maps every
    block above 32 MiB afresh, so a training step's activations, freed in its backward pass, are faulted in and
    zeroed by the kernel again in the next step's forward: 50-100k page faults a step for the 3M model at
    T = 4096 (two threads, Xeon AVX512), which this call takes to 5-10k: 10% more tokens/s there, 4% at T = 1024
    (docs/results-history.md, "Issue 36, item 2"). The price: the process keeps its peak heap. Process-wide; the
    model calls it on its first training forward on CPU (:func:`keep_freed_memory_when_training`). Returns whether
    it applied (False where the C library is not glibc)."""
    global _settled
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # malloc.h
    applied = all(mallopt(option, value) == 1 for option, value in
                  ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30)))
    _settled = _settled or applied  # applied by its caller: the model has nothing to add or say
    return applied


def keep_freed_memory_when_training(x: torch.Tensor) -> None:
    """Called by the model's forward in training mode: the first time gradients are on for CPU tensors, apply
    :func:`keep_freed_memory` (a fresh process trained 1.25-1.37x slower at T = 4096 without it) and say so once in
    the log, unless ``BILINEAR_LM_KEEP_FREED_MEMORY=0`` or the process already applied it. Nothing inside a compiled
    graph, nothing after the first decision."""
    global _settled
    if _settled or torch.compiler.is_compiling() or not torch.is_grad_enabled() or x.device.type != "cpu":
        return
    _settled = True
    if os.environ.get(OPT_OUT_ENV) == "0":
        return
    if keep_freed_memory():
        logger.warning(f"bilinear-lm trains on CPU: glibc's malloc now keeps freed memory for reuse (faster steps; "
                       f"the process keeps its peak heap); {OPT_OUT_ENV}=0 leaves it as it was")
