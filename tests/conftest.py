"""Shared test fixtures: the tests' own data folder and a tiny model config (tiny checkpoints: fixtures.py).

The suite reads no data from outside the repository: tokenizers train on the Tiny Shakespeare text the package ships
(bilinear_lm.training.DEFAULT_TRAIN_FILE), and the local lm-eval tasks read TEST_DATA, a few KB in the layout of
their real data folder, written from that text by tests/data/make_data.py. .ci/run runs the suite in a copy of the
checkout with nothing beside it."""
import gc
import os
from pathlib import Path

import pytest

# torch's OpenMP threads sleep at a barrier instead of spinning (libgomp reads this when torch loads it): on 2 cores
# shared with the suite's own subprocesses, or any other load, spinning threads multiplied the time of parallel ops
# (a depthwise conv1d: 0.1 ms to 300 ms) and of the suite (test_generation + test_hybrid: 64 s to 21 s)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

if not torch.cuda.is_available():  # run the Triton kernels on CPU tensors (set before they are first imported)
    os.environ["TRITON_INTERPRET"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = REPO_ROOT / "tests" / "data"  # wikitext-2-raw/wiki.{valid,test}.raw, lambada/lambada_test.jsonl

torch.set_num_threads(2)


def pytest_collection_finish(session):
    """Move what the test modules imported (torch, transformers, ...: ~460k objects) out of the garbage
    collector's sight: every full collection (automatic, or train.py's at the end of each in-process run) would
    traverse them again, and they live until the end anyway."""
    gc.freeze()


TINY_CONFIG = dict(vocab_size=67, hidden_size=24, num_hidden_layers=2, num_heads=3, state_size=5, rank=7,
                   intermediate_size=40, norm_chunk_size=4)  # tiny_bilinear_config's (module fixtures import it)


@pytest.fixture
def tiny_bilinear_config():
    from bilinear_lm import BilinearConfig

    return BilinearConfig(**TINY_CONFIG)


@pytest.fixture(autouse=True)
def _restore_environment():
    """The environment's contents as before each test: datasets' multiprocess ``map`` replaces ``os.environ`` with a
    copy (arrow_dataset.py, ``os.environ = prev_env``), so monkeypatch's undo can reach the old object only and leave
    a variable a test set (ACCELERATE_MIXED_PRECISION=bf16 leaked into later in-process runs)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
