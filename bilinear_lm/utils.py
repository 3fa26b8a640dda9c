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

    By default every block above 32 MiB (glibc's ceiling for its mmap threshold) is a fresh mapping, returned to the
    system when freed, so each large activation of a training step is faulted in and zeroed by the kernel again:
    13-19% of a CPU training step measured here (docs/results-history.md, "glibc's malloc kept off mmap"). The
    price: the process keeps its peak heap (peak RSS 7-49% higher). Process-wide, so the command-line entry points
    call it, not the library. Returns whether it applied (False where the C library is not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # malloc.h
    return all(mallopt(option, value) == 1 for option, value in
               ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30)))
