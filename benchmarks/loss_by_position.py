"""Validation loss by position: within documents packed into blocks, or within whole long books.

    python benchmarks/loss_by_position.py --checkpoints out/bilinear out/llama \
        --train_file $BILINEAR_LM_DATA_DIR/tinystories/tinystories_sample.txt --block_size 512
    python benchmarks/loss_by_position.py --checkpoints out/bilinear out/llama \
        --books $BILINEAR_LM_DATA_DIR/gutenberg/validation.jsonl --block_size 512 --max_tokens 65536

Blocks (``--train_file``): rebuilds train.py's validation split (same ``--val_fraction``, blocks packed with each
checkpoint's own tokenizer), scores every block, and averages the next-token loss by the target's distance from the
last EOS before it in the block (its position in its document; tokens of a document that began in an earlier block
are left out, their position being unknown).
Books (``--books``, JSON lines with a ``text`` field): each book is one token stream (its first ``--max_tokens``);
a model with a fixed-size state (bilinear, also with sliding-window layers) streams it whole, carrying its state, and
a model with a growing KV cache scores it with sliding windows of ``--block_size`` (its training length) advanced by
half of it (``bilinear_lm.evaluation.perplexity``'s protocols); the loss is averaged by the target's position in
its book.
Prints a markdown table, one row per checkpoint, one column per position bin.
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


def loss_by_book_position(model, books: list[torch.Tensor], edges: list[int], window: int):
    """Mean next-token loss per bin ``[edges[i], edges[i+1])`` of the target's position in its book (``books``: each
    book's ids, a prefix token first), each book streamed whole where the model's state is fixed-size, else scored by
    windows of ``window`` tokens advanced by ``window // 2``; also the bins' target counts and the protocol used."""
    from bilinear_lm.evaluation.perplexity import token_nll

    sums, counts = torch.zeros(len(edges) - 1, dtype=torch.float64), torch.zeros(len(edges) - 1, dtype=torch.long)
    mode = "streaming"
    for ids in books:
        if mode == "streaming":
            try:
                nll = token_nll(model, ids, mode, segment_len=window)
            except ValueError:  # a growing KV cache (streaming refuses it): windows of the training length
                mode = "strided"
        if mode == "strided":
            nll = token_nll(model, ids, mode, max_length=window, stride=window // 2)
        pos = torch.arange(1, len(nll) + 1)  # target i + 1 of the book
        bins = torch.bucketize(pos, torch.tensor(edges), right=True) - 1
        keep = (bins >= 0) & (bins < len(edges) - 1)
        sums.index_add_(0, bins[keep], nll[keep])
        counts.index_add_(0, bins[keep], torch.ones_like(bins[keep]))
    return sums / counts.clamp_min(1), counts, mode if mode == "streaming" else f"strided {window}/{window // 2}"


def clip_edges(edges: list[int], max_tokens: int) -> list[int]:
    """Bin edges for positions 1..max_tokens: the last bin ends at the last position scored (no bin past it, none
    of a single position)."""
    return [e for e in edges if e < max_tokens] + [max_tokens + 1]


def read_books(path: str, tokenizer, max_tokens: int | None) -> list[torch.Tensor]:
    """Each JSON line's ``text``, encoded as the perplexity protocols expect (a prefix token first), cut to
    ``max_tokens`` targets."""
    import json

    from bilinear_lm.evaluation.perplexity import encode_text, prefix_token_id

    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    ids = [encode_text(tokenizer, text, prefix_token_id(tokenizer)) for text in texts]
    return [i[:max_tokens + 1] if max_tokens else i for i in ids]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", nargs="+", required=True, help="train.py output directories (model + tokenizer)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--train_file", help="blocks: the text train.py was given (its split is rebuilt)")
    source.add_argument("--books", help="books: a JSON lines file, one book per line in its 'text' field")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--block_size", type=int, default=512, help="the training length (books: the window of a KV-cache "
                                                                "model, and the streaming segment)")
    p.add_argument("--max_blocks", type=int, default=None, help="blocks: score only the first N validation blocks")
    p.add_argument("--max_tokens", type=int, default=None, help="books: score only each book's first N tokens")
    p.add_argument("--edges", default=None, help="position bin edges (default, blocks: 1,16,64,128,256,512 tokens "
                                                 "after the EOS; books: 1,512,2048,8192,32768,131072)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from bilinear_lm.evaluation.perplexity import load_model_and_tokenizer
    from bilinear_lm.training.data import load_raw_text, tokenize_and_pack

    edges = [int(e) for e in (args.edges or ("1,512,2048,8192,32768,131072" if args.books
                                             else "1,16,64,128,256,512")).split(",")]
    if args.books and args.max_tokens:
        edges = clip_edges(edges, args.max_tokens)
    if args.train_file:
        raw = load_raw_text(dataset=None, dataset_config=None, train_file=args.train_file, validation_file=None,
                            text_column="text", val_fraction=args.val_fraction)
    header = "| checkpoint | " + ("protocol | " if args.books else "") \
        + " | ".join(f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])) + " |"
    lines = [header, "|" + "---|" * (len(edges) + bool(args.books))]
    for ckpt in args.checkpoints:
        model, tokenizer = load_model_and_tokenizer(ckpt)
        if args.books:
            books = read_books(args.books, tokenizer, args.max_tokens)
            losses, counts, protocol = loss_by_book_position(model, books, edges, args.block_size)
            cells = [protocol, *(f"{v:.3f}" for v in losses.tolist())]
        else:
            if tokenizer.eos_token_id is None:
                raise SystemExit(f"{ckpt}: its tokenizer has no EOS token, so documents have no boundaries to count "
                                 "from")
            blocks = tokenize_and_pack(raw, tokenizer, args.block_size).with_format("torch")["validation"]["input_ids"]
            losses, counts = loss_by_position(model, blocks[:args.max_blocks], tokenizer.eos_token_id, edges)
            cells = [f"{v:.3f}" for v in losses.tolist()]
        lines.append(f"| {ckpt} | " + " | ".join(cells) + " |")
        print(f"{ckpt}: targets per bin {counts.tolist()}", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
