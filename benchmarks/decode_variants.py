"""Decoding ms/token of the bilinear model's decoding-path variants, side by side in one process (issue 21).

Every variant runs the same module code; they differ in what the kernels take over: the projections (the compiled
GEMV through ``dispatch.linear``, else ``F.linear``) and the state step (the compiled ``cp_step``, else
``bilinear_reference.reference_step`` in PyTorch). Repetitions interleave the variants, so machine drift hits all alike.

    python benchmarks/decode_variants.py --sizes 3M,25M --context 1024 --new-tokens 128 --reps 3
"""
import argparse
import contextlib
import copy
import time

import torch

from bilinear_lm.modeling import dispatch
from bilinear_lm.modeling.transformers_compat import CACHE_NAME, returned_cache
from bilinear_lm.utils import cpu_name
from speed import SIZES, VOCAB, build

VARIANTS = {  # name: (GEMV, compiled state step)
    "modules + GEMV + cp_step (default)": (True, True),
    "modules + GEMV": (True, False),
    "modules + cp_step": (False, True),
    "modules only": (False, False),
}


@contextlib.contextmanager
def variant(model, gemv: bool, step: bool):
    kernels = dispatch.loaded_cpu_kernels
    impl = model.config.recurrence_impl
    dispatch.loaded_cpu_kernels = kernels if gemv else (lambda: None)
    model.config.recurrence_impl = "auto" if step else "torch"  # the compiled step needs auto/cpp
    try:
        yield
    finally:
        dispatch.loaded_cpu_kernels, model.config.recurrence_impl = kernels, impl


@torch.no_grad()
def ms_per_token(model, cache, token, new_tokens: int) -> float:
    times = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        out = model(token, **{CACHE_NAME: cache}, use_cache=True)
        times.append(time.perf_counter() - start)
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="3M,25M")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_name()}")
    lines = ["| size | variant | ms/token (median per rep) | best |", "|---|---|---|---|"]
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; choose from {list(SIZES)}")
        torch.manual_seed(0)
        model = build("bilinear", size).eval()
        with torch.no_grad():
            out = model(torch.randint(0, VOCAB, (1, args.context)), use_cache=True)  # builds the kernels
        results = {name: [] for name in VARIANTS}
        for _ in range(args.reps):
            for name, (gemv, step) in VARIANTS.items():
                with variant(model, gemv, step):
                    cache = copy.deepcopy(returned_cache(out))
                    results[name].append(ms_per_token(model, cache, out.logits[:, -1:].argmax(-1), args.new_tokens))
        for name, values in results.items():
            lines.append(f"| {size} | {name} | {' / '.join(f'{v:.2f}' for v in values)} | {min(values):.2f} |")
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
