"""Decoding tokens/s with prompt lookup (``generate(prompt_lookup_num_tokens=K)``: drafts copied from the prompt,
verified in one forward, the cache rolled back past the rejected ones) against plain greedy decoding, for trained
checkpoints, side by side in one process (issue 49): rounds interleave the modes, so machine drift hits all alike.

Texts, from a held-out JSONL of documents (``{"text": ...}``), each a passage of ``--passage`` tokens:
* repetitive: the passage followed by its own first ``--repeat`` tokens (the model goes on quoting it);
* fresh: the passage alone (what follows is new text; drafts come only from chance repeats).

Modes: plain eager decoding (``BilinearCache``), prompt lookup (eager: transformers runs assisted decoding
uncompiled), and plain compiled decoding (``cache_implementation="static"``, the fastest plain decoding). The
decoding rate leaves the prompt's prefill out: ``(N - 1) / (t(N) - t(1))`` with
``t(n)`` the time of ``generate`` for ``n`` new tokens. Columns: tokens/s, prompt lookup over plain eager, the
share of drafted tokens accepted, new tokens per verification forward, and whether the tokens equal plain greedy
decoding's (an fp32 argmax can tip where two logits tie to rounding).

    python benchmarks/prompt_lookup.py --models runs/prompt_lookup/3M,runs/prompt_lookup/25M \\
        --data ../shared/data/gutenberg/validation.jsonl --texts 4 --new-tokens 64 --rounds 3
"""
import argparse
import json
import time
from datetime import date

import torch
from transformers import AutoTokenizer
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from bilinear_lm import BilinearForCausalLM
from bilinear_lm.modeling.cache_bilinear import BilinearCacheMixin
from bilinear_lm.utils import cpu_name

MODES = ("plain eager", "prompt lookup", "plain compiled")


def texts(path: str, tokenizer, count: int, passage: int, repeat: int) -> dict[str, list[torch.Tensor]]:
    """``count`` passages from the first documents long enough, one per document, from their middle (past any
    front matter): ``{"repetitive": [...], "fresh": [...]}``, each ``[1, T]`` token ids."""
    out = {"repetitive": [], "fresh": []}
    with open(path) as f:
        for line in f:
            ids = tokenizer(json.loads(line)["text"], return_tensors="pt").input_ids
            if ids.shape[1] < 4 * passage:
                continue
            start = ids.shape[1] // 2
            piece = ids[:, start:start + passage]
            out["fresh"].append(piece)
            out["repetitive"].append(torch.cat([piece, piece[:, :repeat]], dim=1))
            if len(out["fresh"]) == count:
                return out
    raise SystemExit(f"{path}: fewer than {count} documents of {4 * passage} tokens")


class Counts:
    """Drafted and rejected tokens, and verification forwards, while counting."""

    def __init__(self):
        self.drafted = self.rejected = self.forwards = 0

    def __enter__(self):
        self.get_candidates, self.crop = PromptLookupCandidateGenerator.get_candidates, BilinearCacheMixin.crop
        counts = self

        def get_candidates(generator, input_ids, *args, **kwargs):
            candidates, logits = counts.get_candidates(generator, input_ids, *args, **kwargs)
            counts.drafted += candidates.shape[1] - input_ids.shape[1]
            counts.forwards += 1
            return candidates, logits

        def crop(cache, tokens_to_remove):
            counts.rejected += -tokens_to_remove
            return counts.crop(cache, tokens_to_remove)

        PromptLookupCandidateGenerator.get_candidates, BilinearCacheMixin.crop = get_candidates, crop
        return self

    def __exit__(self, *exc):
        PromptLookupCandidateGenerator.get_candidates, BilinearCacheMixin.crop = self.get_candidates, self.crop


def generate(model, ids, new_tokens: int, mode: str, lookup: int):
    kwargs = {"prompt_lookup_num_tokens": lookup} if mode == "prompt lookup" else \
        {"cache_implementation": "static"} if mode == "plain compiled" else {}
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return time.perf_counter() - start, out[0, ids.shape[1]:]


@torch.no_grad()
def measure(model, prompts, args) -> dict:
    """Per mode: decode seconds over all prompts (median of the rounds), and the prompt-lookup counts."""
    for mode in MODES:  # warm up: the kernels' build, the compiled step (one shape for every prompt)
        generate(model, prompts[0], args.new_tokens, mode, args.lookup_tokens)
    seconds = {mode: [] for mode in MODES}
    tokens = {}
    counts = Counts()
    for round_ in range(args.rounds):
        for mode in MODES:
            total = 0.0
            for ids in prompts:
                first, _ = generate(model, ids, 1, mode, args.lookup_tokens)
                if mode == "prompt lookup" and round_ == 0:
                    with counts:
                        full, out = generate(model, ids, args.new_tokens, mode, args.lookup_tokens)
                else:
                    full, out = generate(model, ids, args.new_tokens, mode, args.lookup_tokens)
                total += full - first
                tokens.setdefault((mode, id(ids)), out)
            seconds[mode].append(total)
    same = sum(torch.equal(tokens["prompt lookup", id(ids)], tokens["plain eager", id(ids)]) for ids in prompts)
    median = {mode: sorted(values)[len(values) // 2] for mode, values in seconds.items()}
    return {"seconds": median, "counts": counts, "same": same}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="comma-separated checkpoint folders (model and tokenizer)")
    parser.add_argument("--data", required=True, help="held-out documents, JSONL with a text field")
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--passage", type=int, default=256, help="tokens of each passage")
    parser.add_argument("--repeat", type=int, default=48, help="tokens of its start repeated after it")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{date.today()}, {cpu_name()}, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s); {args.texts} texts of "
          f"{args.passage} tokens (+{args.repeat} repeated), {args.new_tokens} new tokens, "
          f"prompt_lookup_num_tokens={args.lookup_tokens}, median of {args.rounds} rounds\n")
    print("| model | text | plain eager tok/s | prompt lookup tok/s | over plain eager | plain compiled tok/s "
          "| drafts accepted | tokens per verification | same tokens as greedy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.models.split(","):
        model = BilinearForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
        for kind, prompts in texts(args.data, tokenizer, args.texts, args.passage, args.repeat).items():
            result = measure(model, prompts, args)
            rate = {mode: (args.new_tokens - 1) * len(prompts) / s for mode, s in result["seconds"].items()}
            c = result["counts"]
            accepted = 1 - c.rejected / c.drafted if c.drafted else float("nan")
            per_forward = args.new_tokens * len(prompts) / c.forwards
            compiled = f"{rate['plain compiled']:.1f}" if "plain compiled" in rate else "-"
            print(f"| {path} ({size}) | {kind} | {rate['plain eager']:.1f} | {rate['prompt lookup']:.1f} | "
                  f"{rate['prompt lookup'] / rate['plain eager']:.2f}x | {compiled} | "
                  f"{accepted:.0%} of {c.drafted} | {per_forward:.2f} | {result['same']}/{len(prompts)} |",
                  flush=True)


if __name__ == "__main__":
    main()
