#!/usr/bin/env python
"""GPU speed of the bilinear LM: the Triton scan against the PyTorch scan, and training / decoding against Llama.

    python benchmarks/gpu.py                              # all parts, the 125m preset's shape, on cuda:0
    python benchmarks/gpu.py --parts scan --output gpu_scan.md

Parts (each prints a markdown table naming the device; ``--output FILE`` also writes them to FILE):
- ``scan``: the CP recurrence alone (forward + backward, one layer of the preset's shape), microseconds per time
  step, ``recurrence_impl`` triton vs torch.
- ``train``: training tokens/s (forward + backward + AdamW, bf16 autocast) at each ``--seq-lens`` for bilinear
  (triton), bilinear (torch scan) and transformers' Llama with sdpa, parameter-matched
  (``bilinear_lm.baselines.build_model``).
- ``decode``: per-token latency after a context of ``--contexts`` tokens (batch 1, bf16 weights), bilinear
  (recurrent state) vs Llama (KV cache).

Targets (issue 11): the Triton scan >= 30x the PyTorch scan on an H100; bilinear training >= 1.0x Llama's tokens/s
at T=1024 and >= 2x at T=4096.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

from bilinear_lm.baselines import build_model
from bilinear_lm.modeling.dispatch import cp_recurrence
from bilinear_lm.modeling.transformers_compat import CACHE_NAME, returned_cache

PRESET = Path(__file__).resolve().parents[1] / "bilinear_lm" / "configs" / "125m.yaml"
VOCAB = 50257
PARTS = ("scan", "train", "decode")


def cuda_time(fn, min_seconds: float = 1.0, max_iters: int = 50, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` on the GPU (synchronized), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < 3 or (sum(times) < min_seconds and len(times) < max_iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def model_config(impl: str) -> dict:
    return {**yaml.safe_load(PRESET.read_text())["model"], "recurrence_impl": impl}


def build(name: str, max_positions: int):
    """``bilinear-triton`` / ``bilinear-torch`` (the preset's model) or ``llama`` (matched to it, sdpa), on cuda."""
    if name == "llama":
        model = build_model("llama", model_config("auto"), VOCAB)
        model.config.max_position_embeddings = max_positions
        model.config._attn_implementation = "sdpa"
    else:
        model = build_model("bilinear", model_config(name.split("-")[1]), VOCAB)
    return model.cuda()


def part_scan(args) -> str:
    c = model_config("auto")
    N, H, R = c["num_heads"], c["state_size"], c["rank"]
    lines = ["| batch x T | torch scan us/step | triton us/step | speed-up |", "|---|---|---|---|"]
    for T in args.seq_lens:
        u = (1 + 0.02 * torch.randn(args.batch, T, N, R, device="cuda")).requires_grad_()
        W1, W2 = (torch.linalg.qr(torch.randn(N, H, R, device="cuda"))[0].requires_grad_() for _ in range(2))
        h0 = torch.randn(N, H, device="cuda", requires_grad=True)
        per_step = {}
        for impl in ("torch", "triton"):
            def run():
                states, _ = cp_recurrence(u, W1, W2, h0, None, c["norm_chunk_size"], 0, impl)
                states.sum().backward()
            per_step[impl] = cuda_time(run) / T * 1e6
        lines.append(f"| {args.batch} x {T} | {per_step['torch']:.1f} | {per_step['triton']:.2f} | "
                     f"{per_step['torch'] / per_step['triton']:.0f}x |")
        print("  " + lines[-1], flush=True)
    return "\n".join(lines)


def part_train(args) -> str:
    lines = ["| model | params | T | tokens/s | vs Llama |", "|---|---|---|---|---|"]
    for T in args.seq_lens:
        batch = max(1, args.tokens_per_step // T)
        speed = {}
        for name in ("llama", "bilinear-triton", "bilinear-torch"):
            torch.manual_seed(0)
            model = build(name, T).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            ids = torch.randint(0, VOCAB, (batch, T), device="cuda")

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            speed[name] = batch * T / cuda_time(step, min_seconds=3.0, max_iters=20)
            params = sum(p.numel() for p in model.parameters())
            lines.append(f"| {name} | {params / 1e6:.0f}M | {T} | {speed[name]:,.0f} | "
                         f"{speed[name] / speed['llama']:.2f}x |")
            print("  " + lines[-1], flush=True)
            del model, opt
            torch.cuda.empty_cache()
    return "\n".join(lines)


@torch.no_grad()
def part_decode(args) -> str:
    lines = ["| model | context | ms/token |", "|---|---|---|"]
    for name in ("bilinear-triton", "llama"):
        model = build(name, max(args.contexts) + 64).to(torch.bfloat16).eval()
        for context in args.contexts:
            ids = torch.randint(0, VOCAB, (1, context), device="cuda")
            cache = None
            for start in range(0, context, 4096):  # chunked prefill keeps attention memory bounded
                out = model(ids[:, start:start + 4096], **{CACHE_NAME: cache}, use_cache=True)
                cache = returned_cache(out)
            token = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(args.new_tokens):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(token, **{CACHE_NAME: cache}, use_cache=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
            lines.append(f"| {name} | {context} | {sorted(times)[len(times) // 2] * 1e3:.2f} |")
            print("  " + lines[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--seq-lens", default="1024,4096", help="sequence lengths for scan and train")
    parser.add_argument("--batch", type=int, default=16, help="scan part: batch rows")
    parser.add_argument("--tokens-per-step", type=int, default=32768, help="train part: batch = this / T")
    parser.add_argument("--contexts", default="1024,32768")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, help="also write the tables to this markdown file (replaced)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); benchmarks/speed.py "
              "measures the CPU", file=sys.stderr)
        return 1
    args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
    args.contexts = [int(t) for t in args.contexts.split(",")]
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    tables = [f"**{part}** ({device})\n\n" + {"scan": part_scan, "train": part_train, "decode": part_decode}[part](args)
              for part in parts]
    text = "\n\n".join(tables)
    print("\n" + text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
