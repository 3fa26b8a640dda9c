"""Small helpers shared by the library's modules."""

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
