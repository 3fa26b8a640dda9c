"""How far the write coordinate ``c`` falls below the state in trained write-channel models (issue 22).

    python benchmarks/write_range.py --checkpoints runs/gutenberg/matrix4-lr2e-3-1800-seed1337 \
        --books ../shared/data/gutenberg/validation.jsonl --blocks 8 --block_size 512 --dtype float64

With ``write_channel`` each head's state is ``[S; c]`` (``state_columns`` columns of ``state_size`` and one ``c``
each): a write adds ``b k^T c``, so where ``c`` is negligible against ``S`` the head no longer writes and ``A``
alone runs its state. For each checkpoint this scores the first ``--blocks`` blocks of
``--block_size`` tokens of the books (JSON lines with a ``text`` field, concatenated) in ``--dtype`` and prints, per
bilinear layer, the distribution of ``log10(|c| / |S|)`` over (block, position, head) and the share of them below
1e-38 (where fp32, whose smallest normal is 1.2e-38, loses the write); ``c = 0`` counts as -999.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

BELOW = -38  # log10 of the ratio under which the share is counted


def write_ratio(states: torch.Tensor, state_size: int, columns: int) -> torch.Tensor:
    """``[B, T, N, P * (H + 1)]`` mixer states of a write-channel layer -> ``[B, T, N]`` ``log10(|c| / |S|)``, with
    ``|S|`` the Frobenius norm of the ``H x P`` matrix state and ``|c|`` the norm of the ``P`` columns' write
    coordinates; -999 where ``c`` is 0."""
    s = states.unflatten(-1, (columns, state_size + 1))
    return (s[..., state_size].norm(dim=-1) / s[..., :state_size].flatten(-2).norm(dim=-1)).log10().clamp_min(-999)


def ratio_row(ratio: torch.Tensor) -> list[float]:
    """min, 1st percentile, median, max of ``ratio`` and the share below ``10 ** BELOW``."""
    flat = ratio.flatten().double()
    q = torch.quantile(flat, torch.tensor([0.01, 0.5], dtype=flat.dtype))
    return [flat.min().item(), q[0].item(), q[1].item(), flat.max().item(), (flat < BELOW).double().mean().item()]


def read_blocks(path: str, tokenizer, blocks: int, block_size: int) -> torch.Tensor:
    """The first ``blocks * block_size`` tokens of the books in ``path`` (their texts concatenated), ``[blocks,
    block_size]``."""
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= blocks * block_size:
                break
    if len(ids) < blocks * block_size:
        raise SystemExit(f"{path} holds {len(ids)} tokens, fewer than --blocks {blocks} x --block_size {block_size}; "
                         "ask for fewer blocks")
    return torch.tensor(ids[:blocks * block_size]).view(blocks, block_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", nargs="+", required=True, help="train.py output directories (model + tokenizer)")
    p.add_argument("--books", required=True, help="a JSON lines file, one book per line in its 'text' field")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bilinear_lm  # noqa: F401  (registers the Auto classes)

    lines = ["| checkpoint | dtype | loss | layer | min | 1% | median | max | share below 1e-38 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ckpt in args.checkpoints:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype)).eval()
        cfg = model.config
        if not getattr(cfg, "write_channel", False):
            raise SystemExit(f"{ckpt}: the model has no write channel (write_channel is false), so no write "
                             "coordinate to measure; pass write-channel checkpoints only")
        ids = read_blocks(args.books, AutoTokenizer.from_pretrained(ckpt), args.blocks, args.block_size)
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, output_mixer_states=True)
        layers = [i for i, t in enumerate(cfg.layer_types) if t == "bilinear"]
        for layer, states in zip(layers, out.mixer_states):
            cells = ratio_row(write_ratio(states, cfg.state_size, cfg.state_columns))
            lines.append(f"| {ckpt} | {args.dtype} | {out.loss.item():.4f} | {layer} | "
                         + " | ".join(f"{v:.1f}" for v in cells[:4]) + f" | {cells[4]:.3f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
