"""Small helpers shared by the evaluation and benchmark code."""

import sys
from contextlib import contextmanager
from pathlib import Path


def append_results(path: Path, script: str, text: str) -> None:
    """Append ``text`` (markdown tables) to ``path`` under the command line that produced it."""
    with open(path, "a") as f:
        f.write(f"\nCommand: `python {script} {' '.join(sys.argv[1:])}`\n\n{text}\n")


@contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode for the block and restore its train/eval mode afterwards, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
