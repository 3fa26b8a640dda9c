"""Small helpers shared by the library's modules (``keep_freed_memory`` lives with the model, which applies it when it
trains on CPU)."""

import os
from contextlib import contextmanager
from pathlib import Path

from .modeling.cpu_allocator import keep_freed_memory

__all__ = ["cpu_name", "eval_mode", "keep_freed_memory", "save_atomically"]


@contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode for the block and restore its train/eval mode afterwards, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def save_atomically(obj, path) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file beside it, then renamed: an interruption leaves the
    previous whole file (or none), never a partial one."""
    import torch

    tmp = Path(f"{path}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def cpu_name() -> str:
    """The CPU as a timing names it: its model name, family and model (/proc/cpuinfo: "AMD EPYC" names several
    generations) and the SIMD level PyTorch dispatches to (``torch.backends.cpu.get_cpu_capability()``)."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
    except OSError:
        info = {}
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"
