"""Test fixtures: tiny offline checkpoints (no hub access).

``build_tokenizer`` trains train.py's byte-level BPE (``bilinear_lm.training.data.train_bpe_tokenizer``: lossless,
BOS = EOS = pad = ``<|endoftext|>``) on a slice of a text file (default: the Tiny Shakespeare text the package ships).
``save_tiny_checkpoint`` saves a randomly initialized tiny model (llama or bilinear) + that tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch

from bilinear_lm.training import DEFAULT_TRAIN_FILE

DEFAULT_TEXT = Path(DEFAULT_TRAIN_FILE)  # Tiny Shakespeare, package data (public domain)


def build_tokenizer(text_file: str | Path = DEFAULT_TEXT, vocab_size: int = 512, n_chars: int = 200_000):
    """train.py's byte-level BPE (``bilinear_lm.training.data``) trained on the first ``n_chars`` characters of
    ``text_file``."""
    from bilinear_lm.training.data import train_bpe_tokenizer

    text = Path(text_file).read_text(encoding="utf-8")[:n_chars]
    return train_bpe_tokenizer(text.splitlines(keepends=True), vocab_size)


TINY_CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
    "bilinear": dict(hidden_size=32, num_hidden_layers=2, num_heads=2, state_size=8, rank=8, intermediate_size=64,
                     norm_chunk_size=16),
}


def build_tiny_model(model_type: str, vocab_size: int, seed: int = 0, **overrides):
    """A randomly initialized tiny llama or bilinear model (``TINY_CONFIGS`` + overrides) in eval mode."""
    from bilinear_lm.baselines import build_model

    if model_type not in TINY_CONFIGS:
        raise ValueError(f"model_type must be one of {sorted(TINY_CONFIGS)}, got {model_type!r}")
    torch.manual_seed(seed)
    return build_model(model_type, {**TINY_CONFIGS[model_type], **overrides}, vocab_size, match_bilinear=False).eval()


def save_tiny_checkpoint(out_dir: str | Path, model_type: str = "llama", text_file: str | Path = DEFAULT_TEXT,
                         tokenizer=None, seed: int = 0, **overrides):
    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer(text_file)
    model = build_tiny_model(model_type, len(tokenizer), seed=seed, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


_TOKENIZER_CACHE: dict = {}


def cached_tokenizer(text_file: str | Path = DEFAULT_TEXT, vocab_size: int = 512):
    """build_tokenizer memoized per process (tests share one tokenizer across modules)."""
    key = (str(text_file), vocab_size)
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = build_tokenizer(text_file, vocab_size)
    return _TOKENIZER_CACHE[key]

