"""Small helpers shared by the library's modules (``keep_freed_memory`` lives with the model, which applies it when it
trains on CPU)."""

from contextlib import contextmanager

from .modeling.cpu_allocator import keep_freed_memory

__all__ = ["eval_mode", "keep_freed_memory"]


@contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode for the block and restore its train/eval mode afterwards, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
