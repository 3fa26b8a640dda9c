"""Validation loss by position within the document: how much of its context each model uses.

    python benchmarks/loss_by_position.py --checkpoints out/bilinear out/llama \\
        --train_file ../shared/data/tinystories/tinystories_sample.txt --block_size 512

Rebuilds train.py's validation split (same ``--val_fraction``, blocks packed with each checkpoint's own tokenizer),
scores every block, and averages the next-token loss by the target's distance from the last EOS before it in the
block (its position in its document; tokens of a document that began in an earlier block are left out, their
position being unknown). Prints a markdown table, one row per checkpoint, one column per position bin.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def document_positions(ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[B, T] -> [B, T]``: each token's distance from the last EOS at or before it in its row (the EOS itself: 0);
    -1 before a row's first EOS."""
    T = ids.shape[1]
    index = torch.arange(T).expand_as(ids)
    last_eos = torch.where(ids == eos_token_id, index, -1).cummax(dim=1).values
    return torch.where(last_eos >= 0, index - last_eos, -1)


def loss_by_position(model, blocks: torch.Tensor, eos_token_id: int, edges: list[int], batch_size: int = 8):
    """Mean next-token loss of ``model`` on ``blocks`` ``[N, T]`` per bin ``[edges[i], edges[i+1])`` of the target's
    position in its document, and the number of targets in each bin."""
    sums, counts = torch.zeros(len(edges) - 1, dtype=torch.float64), torch.zeros(len(edges) - 1, dtype=torch.long)
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            ids = blocks[i:i + batch_size].long()  # train.py stores int32 ids
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            pos = document_positions(ids, eos_token_id)[:, 1:]
            bins = torch.bucketize(pos, torch.tensor(edges), right=True) - 1  # pos in [edges[k], edges[k+1]) -> k
            keep = (pos >= 0) & (bins >= 0) & (bins < len(edges) - 1)
            sums.index_add_(0, bins[keep], nll[keep].double())
            counts.index_add_(0, bins[keep], torch.ones_like(bins[keep]))
    return sums / counts.clamp_min(1), counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", nargs="+", required=True, help="train.py output directories (model + tokenizer)")
    p.add_argument("--train_file", required=True, help="the text train.py was given (its split is rebuilt)")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--max_blocks", type=int, default=None, help="score only the first N validation blocks")
    p.add_argument("--edges", default="1,16,64,128,256,512", help="position bin edges (tokens after the EOS)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bilinear_lm  # noqa: F401  (registers the Auto classes)
    from bilinear_lm.training.data import load_raw_text, tokenize_and_pack

    edges = [int(e) for e in args.edges.split(",")]
    raw = load_raw_text(dataset=None, dataset_config=None, train_file=args.train_file, validation_file=None,
                        text_column="text", val_fraction=args.val_fraction)
    header = "| checkpoint | " + " | ".join(f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])) + " |"
    lines = [header, "|" + "---|" * len(edges)]
    for ckpt in args.checkpoints:
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        if tokenizer.eos_token_id is None:
            raise SystemExit(f"{ckpt}: its tokenizer has no EOS token, so documents have no boundaries to count from")
        blocks = tokenize_and_pack(raw, tokenizer, args.block_size).with_format("torch")["validation"]["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        losses, counts = loss_by_position(model, blocks[:args.max_blocks], tokenizer.eos_token_id, edges)
        lines.append(f"| {ckpt} | " + " | ".join(f"{v:.3f}" for v in losses.tolist()) + " |")
        print(f"{ckpt}: targets per bin {counts.tolist()}", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
