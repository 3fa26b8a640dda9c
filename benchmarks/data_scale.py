#!/usr/bin/env python
"""Cost of train.py's data pipeline on one file: wall time and peak resident memory of loading, BPE training and
tokenizing + packing (at each --num-proc), and the size of the tokenized data on disk.

    python benchmarks/data_scale.py --file $BILINEAR_LM_DATA_DIR/gutenberg/train.jsonl    # docs/results.md's rows
    python benchmarks/data_scale.py --file $BILINEAR_LM_DATA_DIR/tinystories/tinystories_sample.txt --num-proc 1,2
    python benchmarks/data_scale.py --file FILE --max-mb 5              # the first 5 MB (whole lines) of FILE

Every step runs in its own process with a fresh, empty `datasets` cache (HF_DATASETS_CACHE in a temporary
folder): the cold path, as a first run of train.py meets it. The BPE is trained once (train.py trains it on the
training split; its time and memory are their own row) and every tokenizing run loads it. Peak memory is the
process's own ru_maxrss (also right after loading the text), and the largest of its `num_proc` worker processes';
"over the imports" subtracts the peak after the imports alone and divides by the size of the packed blocks. CPU is
the user + system seconds of the main process and of its workers; "cores busy" is their sum over the wall time (on a
machine that other jobs share, less than the cores the step could use). "on disk" is the bytes of the Arrow
files the run wrote: the packed blocks train.py trains on, and everything in the cache (the text converted to
Arrow, the tokenized rows, the blocks). The file is only read. Prints a markdown table; never run two benchmarks at
once on one machine: the numbers are wall-clock.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peaks_mib() -> tuple[float, float]:
    """Peak resident memory of this process and of its largest waited-for child, MiB (Linux: ru_maxrss in KiB)."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds of this process, and of its waited-for children (the tokenizing workers)."""
    return tuple(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def arrow_bytes(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def child(args) -> dict:
    """One measured step in this (fresh) process: `bpe` trains and saves the tokenizer, `tokenize` loads the text
    and tokenizes + packs it with `num_proc` processes."""
    from transformers import AutoTokenizer

    from bilinear_lm.training.data import build_tokenizer, load_raw_text, tokenize_and_pack

    imports_mib = peaks_mib()[0]  # the libraries alone
    t0 = time.perf_counter()
    raw = load_raw_text(train_file=args.file, val_fraction=args.val_fraction)
    loaded, loaded_mib = time.perf_counter() - t0, peaks_mib()[0]
    if args.step == "bpe":
        t0 = time.perf_counter()
        build_tokenizer("bpe", raw["train"], args.bpe_vocab_size).save_pretrained(args.tokenizer_dir)
        return {"load_s": loaded, "bpe_s": time.perf_counter() - t0, "peak_mib": peaks_mib(), "imports_mib": imports_mib}
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    blocks = tokenize_and_pack(raw, tokenizer, args.block_size, add_eos=args.add_eos, num_proc=args.num_proc)
    seconds, cpu = time.perf_counter() - t0, [after - before for after, before in zip(cpu_seconds(), cpu0)]
    cache = Path(os.environ["HF_DATASETS_CACHE"])
    return {"load_s": loaded, "tokenize_s": seconds, "cpu_s": cpu, "peak_mib": peaks_mib(), "imports_mib": imports_mib,
            "loaded_mib": loaded_mib,
            "tokens": sum(len(ds) for ds in blocks.values()) * args.block_size,
            "blocks_bytes": arrow_bytes(f["filename"] for ds in blocks.values() for f in ds.cache_files),
            "cache_bytes": arrow_bytes(cache.rglob("*.arrow"))}


def run_child(args, step: str, root: Path, num_proc: int = 1) -> dict:
    """`child` in a new process with its own empty datasets cache; returns its measurements."""
    cache = Path(tempfile.mkdtemp(prefix=f"cache_{step}_{num_proc}_", dir=root))
    cmd = [sys.executable, __file__, "--child", step, "--file", args.file, "--num-proc", str(num_proc),
           "--tokenizer-dir", str(root / "tokenizer"), "--block-size", str(args.block_size),
           "--bpe-vocab-size", str(args.bpe_vocab_size), "--val-fraction", str(args.val_fraction),
           "--add-eos", str(args.add_eos)]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{step} (num_proc {num_proc}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def slice_file(path: str, max_mb: float, root: Path) -> str:
    """The first `max_mb` MB of `path`, cut at a line end, as a file in `root` (the input is only read)."""
    name = Path(path).name
    sliced = root / name
    with open(path, "rb") as src, open(sliced, "wb") as dst:
        dst.write(src.read(int(max_mb * 1e6)).rsplit(b"\n", 1)[0] + b"\n")
    return str(sliced)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True, help="a training file (or folder) as train.py takes it")
    parser.add_argument("--num-proc", default="1,2", help="comma-separated --num_proc values to measure")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--bpe-vocab-size", type=int, default=8192)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--add-eos", type=lambda s: s.lower() == "true", default=None,
                        help="default: train.py's (after every row of a JSON / Parquet file, not of a .txt file)")
    parser.add_argument("--max-mb", type=float, default=None, help="measure only the first MAX_MB MB of the file")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.step, args.num_proc = args.child, int(args.num_proc)
        print(json.dumps(child(args)))
        return

    if args.max_mb and not Path(args.file).is_file():
        parser.error(f"--max-mb slices a file; {args.file} is not one")
    from bilinear_lm.training.data import builder_for
    from bilinear_lm.utils import cpu_name

    if args.add_eos is None:
        args.add_eos = builder_for(args.file) != "text"
    shown = args.file + (f" (its first {args.max_mb:g} MB)" if args.max_mb else "")
    with tempfile.TemporaryDirectory(prefix="data_scale_") as tmp:
        root = Path(tmp)
        if args.max_mb:
            args.file = slice_file(args.file, args.max_mb, root)
        files = [Path(args.file)] if Path(args.file).is_file() else Path(args.file).rglob("*")
        size = sum(p.stat().st_size for p in files if p.is_file())
        bpe = run_child(args, "bpe", root)
        runs = {n: run_child(args, "tokenize", root, n) for n in map(int, args.num_proc.split(","))}
    mib = 1 << 20
    lines = [f"Data pipeline on {shown} ({size / mib:.1f} MiB, block_size {args.block_size}, BPE vocabulary "
             f"{args.bpe_vocab_size}, EOS after every row: {args.add_eos}); {cpu_name()}, "
             f"{len(os.sched_getaffinity(0))} usable cores; a fresh datasets cache per run.", "",
             f"BPE training (once, on the training split): {bpe['bpe_s']:.1f} s, peak RSS {bpe['peak_mib'][0]:.0f} MiB "
             f"(loading the text before it: {bpe['load_s']:.1f} s). Peak RSS after the imports alone: "
             f"{bpe['imports_mib']:.0f} MiB.", "",
             "| num_proc | load + check (s) | tokenize + pack (s) | CPU main + workers (s) | cores busy | peak RSS main "
             "after loading (MiB) | peak RSS main (MiB) | peak RSS worker (MiB, 0: none) | over the imports, main / "
             "worker (x the blocks) | tokens packed | blocks on disk (MiB) | all cache files (MiB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in runs.items():
        blocks_mib = r["blocks_bytes"] / mib
        over = [f"{peak - r['imports_mib']:.0f} ({(peak - r['imports_mib']) / blocks_mib:.1f}x)" if peak else "-"
                for peak in r["peak_mib"]]
        lines.append(f"| {n} | {r['load_s']:.1f} | {r['tokenize_s']:.1f} | {r['cpu_s'][0]:.1f} + {r['cpu_s'][1]:.1f} | "
                     f"{sum(r['cpu_s']) / r['tokenize_s']:.2f} | {r['loaded_mib']:.0f} | {r['peak_mib'][0]:.0f} | "
                     f"{r['peak_mib'][1]:.0f} | {' / '.join(over)} | {r['tokens']:,} | {blocks_mib:.1f} | "
                     f"{r['cache_bytes'] / mib:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")


if __name__ == "__main__":
    main()
