"""Small helpers shared by the library's modules (``keep_freed_memory`` lives with the model, which applies it when it
trains on CPU)."""

import os
from contextlib import contextmanager
from pathlib import Path

from .modeling.cpu_allocator import keep_freed_memory

__all__ = ["cpu_name", "eval_mode", "keep_freed_memory", "load_run_checkpoint", "save_atomically"]


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


def load_run_checkpoint(path, run: dict, keys, kind: str, **load_kwargs) -> dict | None:
    """The checkpoint at ``path`` that :func:`save_atomically` wrote for the run ``run`` describes (its ``"run"``
    entry beside ``keys``), loaded with ``torch.load(**load_kwargs)``; None where there is no file. A file of another
    kind, or of another run, is refused with a one-line error naming what differs: a run never continues from another
    run's state. ``kind`` names the caller in the error ("probe run", "recall run")."""
    import torch

    if path is None or not Path(path).exists():
        return None
    saved = torch.load(path, weights_only=False, **load_kwargs)
    if not isinstance(saved, dict) or set(saved) != {"run", *keys}:
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{path} is not a {kind}'s checkpoint (keys {found}); delete it or give another path")
    if saved["run"] != run:
        differ = sorted(k for k in {*run, *saved["run"]} if saved["run"].get(k) != run.get(k))
        raise ValueError(f"{path} is another {kind}'s checkpoint (differing: {', '.join(differ)}); delete it or "
                         f"give another path")
    return saved


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
