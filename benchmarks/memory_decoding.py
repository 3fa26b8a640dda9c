"""Decoding ms/token of the memory heads against the pure model, compiled (``BilinearStaticCache``, one Inductor
program per token, as ``generate(..., cache_implementation="static")``) and eager, side by side in one process
(issue 48, item 4): rounds interleave the models, so machine drift hits all alike.

Rows: the pure bilinear model; the same with 4 memory heads of 32 x 32 per layer (eager, its memory step the C++
``delta_rule_step``; compiled, the loop's PyTorch step, which Inductor fuses with the rest); and, eager only, that
model with the loop's PyTorch step (``delta_rule_reference.reference_delta_rule``, what eager decoding ran before
the kernel).

    python benchmarks/memory_decoding.py --sizes 3M,25M --context 1024 --new-tokens 32 --rounds 6
"""
import argparse
import contextlib
import itertools

import torch

from bilinear_lm.modeling import BilinearStaticCache, modeling_bilinear
from bilinear_lm.modeling.delta_rule_reference import reference_delta_rule
from bilinear_lm.utils import cpu_name
from speed import VOCAB, build, median, prefill, step_times

MODELS = {"pure": "bilinear", "memory heads": "memory-4", "memory heads, the loop's PyTorch step": "memory-4"}


@contextlib.contextmanager
def loop_step(enabled: bool):
    """The memory heads' step as the loop's (``reference_delta_rule``: positional arguments as the module passes
    them, ``impl`` dropped) while enabled."""
    run = modeling_bilinear.memory_recurrence
    if enabled:
        modeling_bilinear.memory_recurrence = lambda *args: reference_delta_rule(*args[:9], args[10])
    try:
        yield
    finally:
        modeling_bilinear.memory_recurrence = run


def decoders(name: str, size: str, context: int, steps: int):
    """``{"eager": (step, cache, token, inputs), "compiled": ...}`` after the same prefill of ``context`` tokens."""
    torch.manual_seed(0)
    model = build(name, size, max_positions=context + steps + 64).eval()
    ids = torch.randint(0, VOCAB, (1, context))
    with torch.no_grad():
        cache, token, _ = prefill(model, ids, 2048)
        static, static_token, _ = prefill(model, ids, 2048, BilinearStaticCache(model.config, context + steps + 1))
    position = itertools.count(context)

    def inputs():
        return {"attention_mask": torch.ones(1, 1, dtype=torch.long), "position_ids": torch.tensor([[next(position)]])}

    compiled = model.get_compiled_call(model._default_compile_config())
    step_times(compiled, static, static_token, 2, inputs)  # compiles
    return {"eager": [model, cache, token, dict], "compiled": [compiled, static, static_token, inputs]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="3M,25M")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per model per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_name()}, context {args.context}, "
          f"{args.rounds} rounds of {args.new_tokens} tokens, medians", flush=True)
    print("\n| size | model | compiled ms/token | over pure | eager ms/token | over pure |\n|---|---|---|---|---|---|")
    torch._dynamo.config.recompile_limit = 64  # one compiled program per model and size, all in this process
    for size in args.sizes.split(","):
        steps = args.rounds * args.new_tokens * 2 + 8
        runs = {label: decoders(name, size, args.context, steps) for label, name in MODELS.items()}
        times = {(label, mode): [] for label in MODELS for mode in ("eager", "compiled")
                 if mode == "eager" or "loop" not in label}
        for _ in range(args.rounds):
            for (label, mode), measured in times.items():
                step, cache, token, inputs = runs[label][mode]
                with loop_step("loop" in label):
                    seconds, tokens = step_times(step, cache, token, args.new_tokens, inputs)
                measured += seconds
                runs[label][mode][2] = tokens[:, -1:]
        ms = {key: median(values) * 1e3 for key, values in times.items()}
        for label in MODELS:
            e = ms[(label, "eager")]
            c = f"{ms[(label, 'compiled')]:.2f} | {ms[(label, 'compiled')] / ms[('pure', 'compiled')]:.2f}x" \
                if (label, "compiled") in ms else "- | -"
            print(f"| {size} | {label} | {c} | {e:.2f} | {e / ms[('pure', 'eager')]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
