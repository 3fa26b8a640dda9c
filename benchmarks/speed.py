#!/usr/bin/env python
"""Speed of the bilinear LM next to Llama, Mamba and an LSTM, on this machine, in one run.

    python benchmarks/speed.py                       # every part but alloc (about 30-40 min on 2 CPU cores)
    python benchmarks/speed.py --parts train --sizes 3M --seq-lens 256,1024
    python benchmarks/speed.py --parts train,alloc --sizes 3M --seq-lens 4096 --models bilinear,llama --malloc default

Parts (each prints a markdown table; ``--output FILE`` also writes them to FILE):
- ``peak``: measured fp32 and bf16 matmul peak of this CPU (the MFU denominator).
- ``train``: training tokens/s (forward + backward + AdamW step) at each sequence length, fp32 and bf16
  autocast, for bilinear (recurrence_impl auto = C++ kernel on CPU), bilinear (reference loop), Llama (sdpa),
  Mamba (its PyTorch path) and an LSTM LM, parameter-matched (bilinear_lm.baselines), and on request
  ``hybrid-K`` (every K-th layer full attention, the others bilinear) and ``memory-K`` (K memory heads of 32 x 32
  beside each mixer's tracking heads), both not parameter-matched; plus model FLOPs utilization, the share of the
  bilinear step spent in the recurrence and the minor page faults of an fp32 step (the mean of the timed steps).
- ``alloc`` (only on request): where a training step's memory comes from, per op, for the ``--models`` at each
  length: the minor page faults inside each op and the MiB of the results it allocates (of 1 MiB and more),
  forward and backward, fp32, the second step of a fresh model (a dispatch mode runs Python between the ops, so
  totals differ a little from a plain step's).
- ``generate``: per-token decode latency and cache memory after a context of 128 .. 32k tokens,
  bilinear (recurrent state; and the ``hybrid-K`` / ``memory-K`` of ``--models``) against Llama (KV cache).
- ``compiled``: decoding ms/token eager (``BilinearCache``) against the compiled step of
  ``generate(..., cache_implementation="static")`` (``BilinearStaticCache``), alternating in rounds, for every size
  and context, bilinear, the ``hybrid-K`` / ``memory-K`` of ``--models`` and, with ``llama`` in ``--models``, Llama
  (``DynamicCache`` against transformers' compiled ``StaticCache`` step); the first compiled call's seconds
  (compilation, from a fresh Inductor cache unless ``--compile-cache``), prefill tokens/s, the weights' bytes per
  token over the time. ``--baseline-tree DIR`` adds the eager decoding of another checkout's bilinear model
  (e.g. a worktree of 0165d8c, the fused C++ block before the redesign), run by that tree's ``speed.py`` in a
  subprocess between the rows of each size.
- ``probe``: training steps/s of the paper's probe setup (state 256, full with one matrix per symbol and CP
  rank 256, batch 64, lengths 2-10).

Never run two benchmarks at once on this machine: the numbers are wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.baselines import build_model, count_parameters
from bilinear_lm.modeling import cpu_allocator
from bilinear_lm.modeling.configuration_bilinear import interleaved_layer_types
from bilinear_lm.modeling.dispatch import cp_recurrence
from bilinear_lm.modeling.transformers_compat import CACHE_NAME, returned_cache
from bilinear_lm.utils import keep_freed_memory

VOCAB = 256  # byte-level: the parameters sit in the blocks being compared
SIZES = {
    "3M": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, state_size=64, rank=64),
    "25M": dict(hidden_size=512, num_hidden_layers=8, num_heads=8, state_size=64, rank=64),
}
TRAIN_MODELS = ("bilinear", "bilinear-reference", "llama", "mamba", "lstm")
SIZED_MODELS = ("hybrid-", "memory-")  # bilinear variants named with a count: hybrid-K, memory-K
PARTS = ("peak", "train", "alloc", "generate", "compiled", "probe")
PRECISIONS = ("fp32", "bf16")


SLOW_CALL_SECONDS = 30.0


def timed(fn, min_seconds: float, max_iters: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls: at least 2 timed calls, more while under ``min_seconds``.

    A warm-up call slower than ``SLOW_CALL_SECONDS`` is taken as the measurement (an upper bound; such
    models are far off the pace anyway and would otherwise take many minutes).
    """
    for _ in range(warmup):
        start = time.perf_counter()
        fn()
        if time.perf_counter() - start > SLOW_CALL_SECONDS:
            return time.perf_counter() - start
    times = []
    while len(times) < 2 or (sum(times) < min_seconds and len(times) < max_iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def build(name: str, size: str, max_positions: int = 4096):
    """A model of TRAIN_MODELS, parameter-matched to the bilinear model of ``SIZES[size]``."""
    model_cfg = SIZES[size]
    if name == "bilinear-reference":
        return build_model("bilinear", {**model_cfg, "recurrence_impl": "reference"}, VOCAB)
    if name.startswith("hybrid-"):
        layer_types = interleaved_layer_types(model_cfg["num_hidden_layers"], int(name.removeprefix("hybrid-")))
        return build_model("bilinear", {**model_cfg, "layer_types": layer_types}, VOCAB)
    if name.startswith("memory-"):
        memory = dict(memory_heads=int(name.removeprefix("memory-")), memory_key_size=32, memory_value_size=32)
        return build_model("bilinear", {**model_cfg, **memory}, VOCAB)
    model = build_model(name, model_cfg, VOCAB)
    if name == "llama":
        model.config.max_position_embeddings = max_positions
    return model


def matmul_peak(dtype, n=2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, 1.0, 20)


def part_peak(args):
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    rows = [f"| {k} | {v / 1e9:.0f} |" for k, v in peaks.items()]
    table = "\n".join(["| dtype | matmul GFLOP/s (2048^3) |", "|---|---|", *rows])
    return peaks, table


def model_flops_per_token(model, seq_len: int) -> float:
    """6 x (parameters used in matmuls) per token, plus the bilinear recurrence (forward 2R^2+2R per head)."""
    embedding = model.get_input_embeddings().weight.numel()
    params = count_parameters(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    matmul_params = params if tied else params - embedding  # the tied embedding is used by the LM head
    flops = 6 * matmul_params
    if isinstance(model, BilinearForCausalLM):
        c = model.config
        flops += 3 * c.num_hidden_layers * c.num_heads * (2 * c.rank ** 2 + 4 * c.state_size * c.rank)
    elif getattr(model.config, "model_type", "") == "llama":
        c = model.config
        flops += 6 * c.num_hidden_layers * seq_len * c.hidden_size  # causal attention scores + values
    return flops


def recurrence_seconds(model, batch: int, seq_len: int) -> float:
    """Forward + backward time of the CP recurrences alone, at the model's shapes (all layers)."""
    c = model.config
    u = (1 + 0.02 * torch.randn(batch, seq_len, c.num_heads, c.rank)).requires_grad_()
    mixer = model.model.layers[0].mixer
    W1, W2, h0 = (p.detach().clone().requires_grad_() for p in (mixer.transition.W1, mixer.transition.W2, mixer.h_start))

    def run():
        states, _ = cp_recurrence(u, W1, W2, h0, None, c.norm_chunk_size, 0, c.recurrence_impl)
        states.sum().backward()

    return c.num_hidden_layers * timed(run, 1.0, 5)


def training_setup(name: str, size: str):
    """A fresh model of ``build(name, size)`` (seed 0) in training mode and its AdamW: what the train and alloc parts
    step."""
    torch.manual_seed(0)
    model = build(name, size).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def part_train(args, peaks):
    lines = ["| size | model | params | T | batch | fp32 tok/s | bf16 tok/s | bf16/fp32 | MFU (vs own peak) | "
             "recurrence share (fp32) | minor faults / step (fp32) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    results = {}
    for size in args.sizes:
        for T in args.seq_lens:
            batch = max(1, args.tokens_per_step // T)
            ids = torch.randint(0, VOCAB, (batch, T))
            for name in args.models:
                model, optimizer = training_setup(name, size)
                tok_s, faults = {}, "-"
                for precision in args.precisions:
                    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
                    step_faults = []

                    def step():
                        start = minor_faults()
                        with autocast:
                            loss = model(ids, labels=ids).loss
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        step_faults.append(minor_faults() - start)

                    seconds = timed(step, args.min_seconds, args.max_iters)
                    tok_s[precision] = batch * T / seconds
                    if precision == "fp32" and len(step_faults) > 1:  # the timed steps (the untimed first maps more)
                        faults = f"{sum(step_faults[1:]) // (len(step_faults) - 1):,}"
                    print(f"  {size} {name} T={T} {precision}: {tok_s[precision]:.0f} tok/s", flush=True)
                flops = model_flops_per_token(model, T)
                mfu = {p: tok_s[p] * flops / peaks[p] for p in tok_s}
                share = "-"
                if name == "bilinear" and "fp32" in tok_s:
                    share = f"{recurrence_seconds(model, batch, T) * tok_s['fp32'] / (batch * T):.0%}"
                results[(size, name, T)] = tok_s
                cell = lambda p, fmt: format(tok_s[p], fmt) if p in tok_s else "-"  # noqa: E731
                ratio = f"{tok_s['bf16'] / tok_s['fp32']:.2f}x" if len(tok_s) == 2 else "-"
                lines.append(
                    f"| {size} | {name} | {count_parameters(model) / 1e6:.2f}M | {T} | {batch} | "
                    f"{cell('fp32', '.0f')} | {cell('bf16', '.0f')} | {ratio} | "
                    f"{' / '.join(f'{mfu[p]:.1%}' for p in tok_s)} | {share} | {faults} |")
                del model, optimizer
                gc.collect()
    ratios = ["", "| size | T | bilinear / llama | bilinear / mamba | bilinear / lstm | C++ / reference loop |",
              "|---|---|---|---|---|---|"]
    for size in args.sizes:
        for T in args.seq_lens:
            base = results.get((size, "bilinear", T))
            if not base:
                continue
            cells = []
            for other in ("llama", "mamba", "lstm", "bilinear-reference"):
                ref = results.get((size, other, T))
                cells.append(f"{base['fp32'] / ref['fp32']:.2f}x" if ref and "fp32" in ref and "fp32" in base else "-")
            ratios.append(f"| {size} | {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ratios + ["", "Ratios are fp32 tokens/s."])


def minor_faults() -> int:
    """Minor page faults of this process so far (each a 4 KiB page the kernel mapped and zeroed on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class OpMemory(TorchDispatchMode):
    """Per op (name and first result's shape): calls, minor page faults inside it, and bytes of the results it
    allocates (storages of 1 MiB and more that none of its inputs share)."""

    def __init__(self):
        super().__init__()
        self.calls, self.faults, self.bytes = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        start = minor_faults()
        out = func(*args, **(kwargs or {}))
        faults = minor_faults() - start
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        key = f"{func.overloadpacket.__name__} {list(results[0].shape) if results else ''}"
        self.calls[key] += 1
        self.faults[key] += faults
        self.bytes[key] += sum(n for t in results if (n := t.untyped_storage().nbytes()) >= 2 ** 20
                               and t.untyped_storage().data_ptr() not in inputs)
        return out


def part_alloc(args):
    lines = ["| size | model | T | batch | op [first result's shape] | calls | minor faults | MiB allocated |",
             "|---|---|---|---|---|---|---|---|"]
    for size in args.sizes:
        for T in args.seq_lens:
            batch = max(1, args.tokens_per_step // T)
            ids = torch.randint(0, VOCAB, (batch, T))
            for name in args.models:
                model, optimizer = training_setup(name, size)

                def step():
                    model(ids, labels=ids).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                step()
                with OpMemory() as ops:
                    step()
                top = sorted(ops.calls, key=lambda k: (ops.faults[k] + ops.bytes[k] / 4096), reverse=True)
                total = (f"| {size} | {name} | {T} | {batch} | **all {len(ops.calls)} ops** | "
                         f"{sum(ops.calls.values())} | {sum(ops.faults.values()):,} | "
                         f"{sum(ops.bytes.values()) / 2 ** 20:,.0f} |")
                lines += [total, *(f"| | | | | {k} | {ops.calls[k]} | {ops.faults[k]:,} | "
                                   f"{ops.bytes[k] / 2 ** 20:,.0f} |" for k in top[:args.alloc_ops])]
                print("  " + total, flush=True)
                del model, optimizer
                gc.collect()
    return "\n".join(lines)


def cache_bytes(cache) -> int:
    """Bytes of every tensor a ``DynamicCache``'s layers hold (keys and values, recurrent and convolution states)."""
    tensors = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            tensors += [t for t in values if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def prefill(model, ids, chunk: int, cache=None):
    """Run ``ids`` through the model in chunks of ``chunk`` (bounded attention memory): ``(cache, next token,
    seconds)``."""
    start = time.perf_counter()
    for begin in range(0, ids.shape[1], chunk):
        out = model(ids[:, begin:begin + chunk], **{CACHE_NAME: cache}, use_cache=True)
        cache = returned_cache(out)
    return cache, out.logits[:, -1:].argmax(-1), time.perf_counter() - start


@torch.no_grad()
def step_times(step, cache, token, steps: int, inputs=dict):
    """Seconds of each of ``steps`` greedy decoding calls ``step(token, cache, **inputs())``, and the tokens."""
    times, tokens = [], []
    for _ in range(steps):
        kwargs = inputs()
        start = time.perf_counter()
        out = step(token, **{CACHE_NAME: cache}, use_cache=True, **kwargs)
        times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return times, torch.cat(tokens, 1)


def median(values):
    return sorted(values)[len(values) // 2]


def decode_latency(model, context: int, new_tokens: int, prefill_chunk: int):
    cache, token, _ = prefill(model, torch.randint(0, VOCAB, (1, context)), prefill_chunk)
    times, _ = step_times(model, cache, token, new_tokens)
    return median(times), cache_bytes(cache)


def part_generate(args):
    lines = ["| size | model | context | ms/token | cache KiB |", "|---|---|---|---|---|"]
    latency = {}
    size = args.sizes[-1]
    for name in ("bilinear", "llama", *(m for m in args.models if m.startswith(SIZED_MODELS))):
        torch.manual_seed(0)
        model = build(name, size, max_positions=max(args.contexts) + 64).eval()
        for context in args.contexts:
            seconds, nbytes = decode_latency(model, context, args.new_tokens, args.prefill_chunk)
            latency[(name, context)] = seconds
            lines.append(f"| {size} | {name} | {context} | {seconds * 1e3:.2f} | {nbytes / 2 ** 10:.2f} |")
            print("  " + lines[-1], flush=True)
        del model
        gc.collect()
    lo, hi = min(args.contexts), max(args.contexts)
    lines += ["", f"Bilinear latency at {hi} / at {lo}: {latency[('bilinear', hi)] / latency[('bilinear', lo)]:.2f}x; "
              + ", ".join(f"Llama / bilinear at {c}: {latency[('llama', c)] / latency[('bilinear', c)]:.1f}x"
                          for c in args.contexts)]
    return "\n".join(lines)


def copy_bandwidth(n: int = 2 ** 26) -> float:
    """Bytes/s of a large fp32 copy (read + write), this machine's memory bandwidth as torch reaches it."""
    src, dst = torch.randn(n), torch.empty(n)
    return 2 * 4 * n / timed(lambda: dst.copy_(src), 1.0, 20)


def part_compiled(args):
    """Decoding eager (``BilinearCache``, module code + C++ kernels) against the compiled step that
    ``generate(..., cache_implementation="static")`` runs (``BilinearStaticCache``, one Inductor program per token),
    side by side: rounds alternate the two on the same prompt, so drift hits both alike."""
    from transformers import StaticCache

    from bilinear_lm.modeling import BilinearStaticCache

    if not args.compile_cache:  # each row's first compiled call compiles from scratch, as on a fresh machine
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="speed-inductor-")
    bandwidth = copy_bandwidth()
    lines = [f"Memory bandwidth (fp32 copy): {bandwidth / 1e9:.1f} GB/s. Weights GB/s: parameter bytes per token "
             "over the compiled ms/token. The logit difference: eager and compiled after the same prefill (later "
             "steps drift apart as a random model amplifies rounding).", "",
             "| size | model | context | prefill tok/s | eager ms/token | compiled ms/token | speed-up | weights GB/s "
             "| first compiled call s | first step: max abs logit difference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rounds = 4
    names = ["bilinear", *(m for m in args.models if m.startswith(SIZED_MODELS))] + ["llama"] * ("llama" in args.models)
    compiled_ms = {}
    for size in args.sizes:
        if args.baseline_tree:
            for context, ms in baseline_decoding(args.baseline_tree, size, args.contexts, rounds * args.new_tokens,
                                                 args.prefill_chunk).items():
                compiled_ms[(size, "baseline", context)] = ms
                lines.append(f"| {size} | bilinear, {args.baseline_tree.name} (eager) | {context} | - | {ms:.2f} | - | "
                             "- | - | - | - |")
                print("  " + lines[-1], flush=True)
        for name in names:
            torch.manual_seed(0)
            model = build(name, size, max_positions=max(args.contexts) + rounds * args.new_tokens + 64).eval()
            static_cache = StaticCache if name == "llama" else BilinearStaticCache
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            prefill(model, torch.randint(0, VOCAB, (1, 64)), args.prefill_chunk)  # first calls' setup, untimed
            for context in args.contexts:
                ids = torch.randint(0, VOCAB, (1, context))
                cache, token, seconds = prefill(model, ids, args.prefill_chunk)
                max_cache_len = context + rounds * args.new_tokens + 1
                static, _, _ = prefill(model, ids, args.prefill_chunk, static_cache(model.config, max_cache_len))
                torch._dynamo.reset()
                compiled = model.get_compiled_call(model._default_compile_config())
                position = itertools.count(context)

                def inputs():  # the position (rotary embeddings) and, for our model, its own position's mask (Llama's
                    # would span the whole cache: with one unpadded sequence it takes none)
                    mask = {} if name == "llama" else {"attention_mask": torch.ones(1, 1, dtype=torch.long)}
                    return {**mask, "position_ids": torch.tensor([[next(position)]])}

                with torch.no_grad():
                    eager_logits = model(token, **{CACHE_NAME: cache}, use_cache=True).logits[:, -1]
                    start = time.perf_counter()
                    compiled_logits = compiled(token, **{CACHE_NAME: static}, use_cache=True, **inputs()).logits[:, -1]
                    first = time.perf_counter() - start  # compiles
                difference = (eager_logits - compiled_logits).abs().max().item()
                eager_token, compiled_token = eager_logits.argmax(-1, keepdim=True), compiled_logits.argmax(-1, True)
                eager_times, compiled_times = [], []
                for _ in range(rounds):
                    times, new = step_times(model, cache, eager_token, args.new_tokens)
                    eager_times, eager_token = eager_times + times, new[:, -1:]
                    times, new = step_times(compiled, static, compiled_token, args.new_tokens, inputs)
                    compiled_times, compiled_token = compiled_times + times, new[:, -1:]
                eager, fast = median(eager_times) * 1e3, median(compiled_times) * 1e3
                compiled_ms[(size, name, context)] = fast
                lines.append(f"| {size} | {name} | {context} | {context / seconds:.0f} | {eager:.2f} | "
                             f"{fast:.2f} | {eager / fast:.2f}x | {weights / fast / 1e6:.1f} | "
                             f"{first:.1f} | {difference:.1e} |")
                print("  " + lines[-1], flush=True)
            del model
            gc.collect()
    baseline = args.baseline_tree.name if args.baseline_tree else None
    for other, label in (("llama", "Llama's compiled ms/token"), ("baseline", f"{baseline}'s eager ms/token")):
        ratios = [f"{size} at {c}: {compiled_ms[(size, other, c)] / compiled_ms[(size, 'bilinear', c)]:.2f}x"
                  for size in args.sizes for c in args.contexts if (size, other, c) in compiled_ms]
        if ratios:
            lines += ["", f"{label} over the compiled bilinear model's: " + ", ".join(ratios)]
    return "\n".join(lines)


def baseline_decoding(tree: Path, size: str, contexts, new_tokens: int, prefill_chunk: int) -> dict:
    """Median eager decoding ms/token of the bilinear model of ``size`` at each context, measured by another
    checkout's ``benchmarks/speed.py`` (its ``build`` and ``decode_latency``) in a subprocess, with its own kernel
    build folder."""
    tree = tree.resolve()  # the subprocess runs elsewhere
    script = ("import json, torch, speed\n"
              f"torch.manual_seed(0); model = speed.build('bilinear', {size!r}).eval()\n"
              f"print(json.dumps({{c: speed.decode_latency(model, c, {new_tokens}, {prefill_chunk})[0] * 1e3 "
              f"for c in {list(contexts)!r}}}))")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tree / ".torch_extensions"), "PYTHONPATH": str(tree)}
    # run from DIR/benchmarks (its speed.py) with DIR first on the import path (its bilinear_lm)
    out = subprocess.run([sys.executable, "-c", script], cwd=tree / "benchmarks", env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"--baseline-tree {tree}: its decoding failed:\n{out.stderr[-2000:]}")
    return {int(c): ms for c, ms in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def part_probe(args):
    lines = ["| model | state | rank / symbols | steps/s |", "|---|---|---|---|"]
    symbols = 10
    for mixer, rank in (("full", symbols), ("cp", 256)):
        config = BilinearConfig(vocab_size=symbols, hidden_size=256, num_hidden_layers=1, use_mlp=False,
                                num_heads=1, state_size=256, rank=rank, mixer_type=mixer, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = BilinearForCausalLM(config).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(0)

        def step():
            length = int(torch.randint(2, 11, (1,), generator=generator))
            ids = torch.randint(0, symbols, (64, length), generator=generator)
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(step, 3.0, 500, warmup=3)
        lines.append(f"| bilinear-{mixer} | 256 | {rank} | {1 / seconds:.0f} |")
        print("  " + lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda cast: (lambda s: [cast(x) for x in s.split(",")])  # noqa: E731
    parser.add_argument("--parts", type=csv(str), default=[p for p in PARTS if p != "alloc"])
    parser.add_argument("--sizes", type=csv(str), default=list(SIZES))
    parser.add_argument("--seq-lens", type=csv(int), default=[256, 1024, 4096])
    parser.add_argument("--models", type=csv(str), default=list(TRAIN_MODELS))
    parser.add_argument("--precisions", type=csv(str), default=list(PRECISIONS))
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--max-iters", type=int, default=5)
    parser.add_argument("--contexts", type=csv(int), default=[128, 1024, 8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--alloc-ops", type=int, default=12, help="alloc: the ops listed per model (most faults first)")
    parser.add_argument("--malloc", choices=("kept", "model", "default"), default="kept",
                        help="kept (default): bilinear_lm.utils.keep_freed_memory() first, as train.py; model: "
                             "glibc's own settings until the model's first training forward on CPU applies it (a "
                             "library user's process); default: glibc's own settings throughout "
                             "(BILINEAR_LM_KEEP_FREED_MEMORY=0)")
    parser.add_argument("--compile-cache", action="store_true",
                        help="compiled: keep Inductor's on-disk caches (default: a fresh one, a cold first call)")
    parser.add_argument("--baseline-tree", type=Path,
                        help="compiled: also decode with this checkout's bilinear model (its own speed.py), e.g. 0165d8c")
    parser.add_argument("--output", type=Path, help="also write the tables to this markdown file (replaced)")
    args = parser.parse_args(argv)
    for flag, values, choices in (("--parts", args.parts, PARTS), ("--sizes", args.sizes, SIZES),
                                  ("--models", args.models, TRAIN_MODELS), ("--precisions", args.precisions, PRECISIONS)):
        sized = " or hybrid-K or memory-K" if flag == "--models" else ""
        for value in values:
            if value not in choices and not (sized and re.fullmatch(r"(hybrid|memory)-[1-9]\d*", value)):
                parser.error(f"{flag}: unknown value {value!r}; choose from {list(choices)}{sized}")

    if args.baseline_tree and not (args.baseline_tree / "benchmarks" / "speed.py").is_file():
        parser.error(f"--baseline-tree: {args.baseline_tree} has no benchmarks/speed.py; pass a checkout of this "
                     "repository (git worktree add --detach DIR COMMIT)")
    if args.malloc == "default":
        os.environ[cpu_allocator.OPT_OUT_ENV] = "0"
    kept = keep_freed_memory() if args.malloc == "kept" else args.malloc == "model" and "from the first training step"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    machine = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu}, "
               f"ATen capability {torch.backends.cpu.get_cpu_capability()}, malloc keeps freed memory: {kept}")
    print(machine, flush=True)
    peaks, tables = None, [f"Machine: {machine}"]
    if "peak" in args.parts or "train" in args.parts:
        peaks, table = part_peak(args)
        tables.append("### Matmul peak\n\n" + table)
    if "train" in args.parts:
        tables.append("### Training throughput\n\n" + part_train(args, peaks))
    if "alloc" in args.parts:
        tables.append("### Memory of a training step, per op\n\n" + part_alloc(args))
    if "generate" in args.parts:
        tables.append("### Generation\n\n" + part_generate(args))
    if "compiled" in args.parts:
        tables.append("### Compiled decoding\n\n" + part_compiled(args))
    if "probe" in args.parts:
        tables.append("### Probe training (paper setup)\n\n" + part_probe(args))
    text = "\n\n".join(tables)
    print("\n" + text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
