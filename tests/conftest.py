"""Shared test fixtures: the offline data directory and a tiny model config (tiny checkpoints: fixtures.py)."""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # run the Triton kernels on CPU tensors (set before they are first imported)
    os.environ["TRITON_INTERPRET"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT.parent / "shared" / "data"

torch.set_num_threads(2)


@pytest.fixture
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.fail(f"offline data not found at {DATA_DIR} (expected ../shared/data beside the repo)")
    return DATA_DIR


@pytest.fixture
def tiny_bilinear_config():
    from bilinear_lm import BilinearConfig

    return BilinearConfig(
        vocab_size=67, hidden_size=24, num_hidden_layers=2, num_heads=3, state_size=5, rank=7,
        intermediate_size=40, norm_chunk_size=4,
    )
