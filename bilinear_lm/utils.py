"""Small helpers shared by the library's modules."""

import ctypes
import ctypes.util
from contextlib import contextmanager


@contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode for the block and restore its train/eval mode afterwards, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse: no ``mmap`` for large blocks, no trimming of the heap.

    By default glibc returns the top of its heap to the system whenever 64 MiB or more of it is free, and maps every
    block above 32 MiB afresh, so a training step's activations, freed in its backward pass, are faulted in and
    zeroed by the kernel again in the next step's forward: 50-100k page faults a step for the 3M model at
    T = 4096 (two threads, Xeon AVX512), which this call takes to 5-10k: 10% more tokens/s there, 4% at T = 1024
    (docs/results-history.md, "Issue 36, item 2"). The price: the process keeps its peak heap. Process-wide, so the
    library never calls it: train.py, the probe CLIs and ``benchmarks/speed.py`` do, first thing; call it at the
    start of your own CPU training script for the same gain. Returns whether it applied (False where the C library
    is not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # malloc.h
    return all(mallopt(option, value) == 1 for option, value in
               ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30)))
