"""Perplexity of a causal LM over a whole text: token ppl, word ppl and bits per byte.

Three protocols, importable (each returns ``(total_nll, n_tokens)``):

* ``streaming`` (recurrent models): feed the text in segments of ``segment_len`` tokens and carry
  the recurrent state across segments (the returned cache passed back, ``use_cache=True``).
  Every token is conditioned on the entire preceding text; memory is O(1) in the text length.
* ``strided`` (any causal LM, the protocol of the HF "Perplexity of fixed-length models" guide):
  windows of ``max_length`` tokens advanced by ``stride``; only the tokens not scored by an earlier
  window (at most the last ``stride`` of each window) are scored.
* ``rolling``: lm-eval-harness's ``loglikelihood_rolling`` windows (disjoint ``max_length`` windows),
  to reproduce its per-document numbers.
Attention models return a growing KV cache, not a recurrent state: streaming refuses them (names
``--mode strided``); ``--mode both`` then reports strided only, with a note. A bilinear hybrid streams exactly when its
attention layers are all sliding-window ones (their cache keeps a fixed window); with a full-attention layer it is an
attention model here.

Conventions (shared with lm-eval-harness rolling loglikelihood):
the text is tokenized once without special tokens and a single prefix token (BOS, else EOS) is
prepended, so that *every* text token is predicted: ``tokens = len(input_ids) - 1``.
``word_perplexity = exp(nll / words)`` with ``words = len(re.split(r"\\s+", text))`` (lm-eval's wikitext
definition), ``bits_per_byte = nll / bytes / ln 2`` with ``bytes = len(text.encode("utf-8"))``.

CLI: ``bilinear-perplexity`` once installed, ``python eval/perplexity.py`` in a checkout (same arguments)::

    bilinear-perplexity --model CKPT --file $BILINEAR_LM_DATA_DIR/wikitext-2-raw/wiki.test.raw \\
        --mode both --segment_len 512 --max_length 1024 --stride 512 --output ppl.json
    bilinear-perplexity --model CKPT --dataset wikitext --dataset_config wikitext-2-raw-v1 --split test
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..modeling.input_checks import check_token_ids
from ..modeling.transformers_compat import cache_argument, returned_cache
from ..utils import eval_mode

__all__ = [
    "streaming_perplexity",
    "strided_perplexity",
    "rolling_perplexity",
    "token_nll",
    "encode_text",
    "text_stats",
    "perplexity_metrics",
    "cache_kind",
    "evaluate_text",
    "load_model_and_tokenizer",
    "main",
]

# model_type values whose cache is a fixed-size recurrent state (streaming is O(1) memory)
RECURRENT_MODEL_TYPES = {"bilinear", "mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}


# ----------------------------------------------------------------------------- helpers
def _as_1d(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"input_ids must be one sequence ([T] or [1, T]); got shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D or [1, T]; got shape {tuple(ids.shape)}")
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens (a prefix token and one token to predict), got {ids.numel()}; "
                         "pass a longer text")
    return ids


def _model_ids(model, input_ids) -> torch.Tensor:
    """``input_ids`` as one 1-D sequence on the model's device, every id checked against the vocabulary."""
    ids = _as_1d(input_ids)
    check_token_ids(ids, model.get_input_embeddings().num_embeddings,
                    "the tokenizer does not match the model; tokenize with the model's own tokenizer (the one saved "
                    "with the checkpoint, or --tokenizer PATH)")
    return ids.to(_model_device(model))


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) of every target, float64 on the CPU (log-softmax in >= float32; float64 logits stay float64)."""
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits, targets.reshape(-1).to(logits.device), reduction="none").double().cpu()


def cache_kind(model, cache) -> str:
    """Classify a returned cache: "none", "kv" (grows with the context: full attention, also a hybrid's
    full-attention layers) or "recurrent" (fixed-size: recurrent states, sliding-window attention)."""
    if cache is None:
        return "none"
    try:
        from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
    except Exception:  # pragma: no cover
        return "recurrent"
    if isinstance(cache, Cache):
        layers = getattr(cache, "layers", None) or []
        growing = (isinstance(layer, (DynamicLayer, StaticLayer)) and not getattr(layer, "is_sliding", False)
                   for layer in layers)
        return "kv" if any(growing) else "recurrent"
    if getattr(getattr(model, "config", None), "model_type", None) in RECURRENT_MODEL_TYPES:
        return "recurrent"
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)):
        return "kv"  # legacy ((k, v), ...) format
    return "recurrent"


# ----------------------------------------------------------------------------- protocols
def _summed(token_nll: torch.Tensor) -> tuple[float, int]:
    return float(token_nll.sum()), token_nll.numel()


def streaming_perplexity(model, input_ids, segment_len: int = 512, allow_kv_cache: bool = False):
    """Exact NLL of ``input_ids[1:]`` given everything before, streaming segments and carrying the
    model's recurrent state. Returns ``(total_nll, n_tokens)`` with ``n_tokens = len(input_ids) - 1``.

    Raises ValueError for models that return no cache, or an attention KV cache (which grows with the
    text and is limited by the position range) unless ``allow_kv_cache=True``; use
    :func:`strided_perplexity` (``--mode strided``) for those."""
    return _summed(token_nll(model, input_ids, "streaming", segment_len=segment_len, allow_kv_cache=allow_kv_cache))


def strided_perplexity(model, input_ids, max_length: int = 1024, stride: int = 512):
    """NLL with the strided sliding-window protocol of the HF perplexity guide: windows
    ``ids[begin:begin+max_length]`` for ``begin = 0, stride, 2*stride, ...``; each window scores only the
    tokens not scored before (the last ``stride`` tokens, all but the first for the first window).
    Returns ``(total_nll, n_tokens)``, ``n_tokens = len(input_ids) - 1``.

    ``stride = max_length - 1`` gives disjoint windows equivalent to lm-eval's rolling loglikelihood
    with ``max_length - 1``; ``max_length >= len(input_ids)`` is one full forward pass."""
    return _summed(token_nll(model, input_ids, "strided", max_length=max_length, stride=stride))


def rolling_perplexity(model, input_ids, max_length: int = 2048):
    """NLL with lm-eval-harness's ``loglikelihood_rolling`` windows (HFLM, context_len=1): disjoint
    windows each predicting ``max_length`` tokens from ``max_length`` inputs; the last, partial window
    is left-extended to ``max_length`` inputs (more context, only its new tokens scored). With the
    prefix token at ``input_ids[0]`` this reproduces lm-eval's per-document number exactly.
    Returns ``(total_nll, n_tokens)``."""
    return _summed(token_nll(model, input_ids, "rolling", max_length=max_length))


def token_nll(model, input_ids, mode: str = "streaming", segment_len: int = 512, max_length: int = 1024,
              stride: int = 512, allow_kv_cache: bool = False) -> torch.Tensor:
    """``-log p(input_ids[i] | before)`` for every ``i >= 1`` (float64, ``[len(input_ids) - 1]``) under the
    protocol ``mode`` (``streaming``, ``strided`` or ``rolling``; the arguments of the functions above): e.g. the
    loss by position within long documents (``benchmarks/loss_by_position.py --books``)."""
    protocols = {"streaming": lambda ids: _streaming(model, ids, segment_len, allow_kv_cache),
                 "strided": lambda ids: _strided(model, ids, max_length, stride),
                 "rolling": lambda ids: _rolling(model, ids, max_length)}
    if mode not in protocols:
        raise ValueError(f"mode must be one of {sorted(protocols)}, got {mode!r}")
    nlls = protocols[mode](_model_ids(model, input_ids))
    return torch.cat(nlls) if nlls else torch.zeros(0, dtype=torch.float64)


def _progress(windows: range, mode: str):
    """The windows of a protocol, with a progress bar when they take more than 2 s (stderr)."""
    return tqdm(windows, desc=f"{mode} perplexity", unit="window", leave=False, delay=2, dynamic_ncols=True)


@torch.inference_mode()
def _streaming(model, ids, segment_len: int, allow_kv_cache: bool) -> list[torch.Tensor]:
    if segment_len < 1:
        raise ValueError(f"segment_len must be >= 1, got {segment_len}")
    with eval_mode(model):
        nlls, past = [], None
        n_in = ids.numel() - 1  # inputs ids[0:n_in] predict ids[1:n_in+1]
        for start in _progress(range(0, n_in, segment_len), "streaming"):
            end = min(start + segment_len, n_in)
            kwargs = {"use_cache": True}
            if past is not None:
                kwargs[cache_argument(model)] = past
            out = model(input_ids=ids[start:end].unsqueeze(0), **kwargs)
            nlls.append(_nll(out.logits[0], ids[start + 1 : end + 1]))
            past = returned_cache(out)
            if end < n_in:
                kind = cache_kind(model, past)
                if kind == "none":
                    raise ValueError(
                        f"{type(model).__name__} returned no cache, so its state cannot be carried "
                        "across segments; use --mode strided (strided_perplexity) for this model")
                if kind == "kv" and not allow_kv_cache:
                    raise ValueError(
                        f"{type(model).__name__} has a full-attention KV cache, not a fixed-size state: streaming "
                        "would grow memory with the text and exceed the position range; use --mode strided "
                        "(strided_perplexity) for this model")
        return nlls


@torch.inference_mode()
def _strided(model, ids, max_length: int, stride: int) -> list[torch.Tensor]:
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if not 1 <= stride <= max_length - 1:
        raise ValueError(f"stride must be in [1, max_length - 1] = [1, {max_length - 1}], got {stride}")
    with eval_mode(model):
        seq_len = ids.numel()
        nlls, prev_end = [], 1  # ids[0] (prefix) is never scored
        for begin in _progress(range(0, seq_len, stride), "strided"):  # the loop may stop before the bar is full
            end = min(begin + max_length, seq_len)
            if end <= prev_end:
                break
            out = model(input_ids=ids[begin:end].unsqueeze(0), use_cache=False)
            # logits[j] predicts ids[begin + j + 1]; score targets ids[prev_end:end]
            first = prev_end - begin - 1
            nlls.append(_nll(out.logits[0, first : end - begin - 1], ids[prev_end:end]))
            prev_end = end
            if end == seq_len:
                break
        return nlls


@torch.inference_mode()
def _rolling(model, ids, max_length: int) -> list[torch.Tensor]:
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    with eval_mode(model):
        seq_len = ids.numel()
        nlls = []
        for s in _progress(range(1, seq_len, max_length), "rolling"):  # targets ids[s:e]
            e = min(s + max_length, seq_len)
            begin = max(0, e - 1 - max_length)
            out = model(input_ids=ids[begin : e - 1].unsqueeze(0), use_cache=False)
            nlls.append(_nll(out.logits[0, s - 1 - begin :], ids[s:e]))
        return nlls


# ----------------------------------------------------------------------------- text side
def prefix_token_id(tokenizer) -> int:
    """BOS if the tokenizer has one, else EOS (lm-eval's HFLM.prefix_token_id rule)."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError("the tokenizer has neither a BOS nor an EOS token, needed as the prefix token that "
                     "conditions the first text token; add one (tokenizer.add_special_tokens) or pass prefix_id")


def encode_text(tokenizer, text: str, prefix_id: int | None = None) -> torch.Tensor:
    """Tokenize ``text`` once (no special tokens) and prepend the prefix token: a 1-D LongTensor."""
    if prefix_id is None:
        prefix_id = prefix_token_id(tokenizer)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if len(ids) == 0:
        raise ValueError(f"the text tokenizes to zero tokens (text of {len(text)} characters); pass a non-empty text")
    return torch.tensor([prefix_id] + list(ids), dtype=torch.long)


def text_stats(text: str) -> dict:
    """Word and byte counts of the raw text (lm-eval wikitext definitions)."""
    return {"words": len(re.split(r"\s+", text)), "bytes": len(text.encode("utf-8"))}


def perplexity_metrics(total_nll: float, tokens: int, words: int, n_bytes: int) -> dict:
    return {
        "nll": total_nll,
        "tokens": tokens,
        "words": words,
        "bytes": n_bytes,
        "token_perplexity": math.exp(total_nll / tokens),
        "word_perplexity": math.exp(total_nll / words),
        "byte_perplexity": math.exp(total_nll / n_bytes),
        "bits_per_byte": total_nll / n_bytes / math.log(2),
    }


def evaluate_text(model, tokenizer, text: str, modes=("streaming",), segment_len: int = 512,
                  max_length: int = 1024, stride: int = 512, allow_kv_cache: bool = False,
                  skip_unsupported_streaming: bool = False) -> dict:
    """Tokenize ``text`` once and run each protocol; returns {mode: metrics dict}. With
    ``skip_unsupported_streaming`` a model without a recurrent cache gets a printed note instead of the
    streaming ValueError (used by ``--mode both``)."""
    ids = encode_text(tokenizer, text)
    stats = text_stats(text)
    results = {}
    for mode in modes:
        if mode == "streaming":
            try:
                nll, n = streaming_perplexity(model, ids, segment_len, allow_kv_cache=allow_kv_cache)
            except ValueError as exc:
                if not skip_unsupported_streaming:
                    raise
                print(f"note: streaming skipped: {exc}", file=sys.stderr)
                continue
            params = {"segment_len": segment_len}
        elif mode == "strided":
            nll, n = strided_perplexity(model, ids, max_length, stride)
            params = {"max_length": max_length, "stride": stride}
        elif mode == "rolling":
            nll, n = rolling_perplexity(model, ids, max_length)
            params = {"max_length": max_length}
        else:
            raise ValueError(f"unknown mode {mode!r}; use streaming | strided | rolling")
        results[mode] = {**perplexity_metrics(nll, n, stats["words"], stats["bytes"]), **params}
    return results


# ----------------------------------------------------------------------------- CLI
def load_model_and_tokenizer(ckpt: str, tokenizer_path: str | None = None, trust_remote_code: bool = False,
                             dtype: str = "float32", device: str = "cpu"):
    """A ``save_pretrained`` checkpoint and its tokenizer (from the checkpoint or ``tokenizer_path``), in eval
    mode; a missing or unloadable checkpoint or tokenizer is a ValueError that says what to pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bilinear_lm.baselines  # noqa: F401  (registers the peers train.py saves: "gated_deltanet", "lstm")

    path = Path(ckpt)  # model_type "bilinear" is registered by importing bilinear_lm (this module is in it)
    if not path.exists():
        raise ValueError(f"checkpoint {ckpt!r} does not exist (pass a directory written by save_pretrained)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{ckpt!r} has no config.json; is it a save_pretrained checkpoint directory?")
    tok_src = tokenizer_path or ckpt
    tok_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                 "vocab.txt")
    if Path(tok_src).is_dir() and not any((Path(tok_src) / f).is_file() for f in tok_files):
        raise ValueError(f"no tokenizer files in {tok_src!r} (expected tokenizer.json / tokenizer_config.json). "
                         "Save the tokenizer with the model (tokenizer.save_pretrained(CKPT)) or pass --tokenizer PATH")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ValueError(f"could not load a tokenizer from {tok_src!r} ({type(exc).__name__}: {exc}). "
                         "Save the tokenizer next to the model (tokenizer.save_pretrained(CKPT)) or pass --tokenizer PATH")
    if tokenizer is None or isinstance(tokenizer, bool):
        raise ValueError(f"no tokenizer found in {tok_src!r}; pass --tokenizer PATH")
    torch_dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ValueError(f"could not load a causal LM from {ckpt!r} ({type(exc).__name__}: {exc}); "
                         "for custom code pass --trust_remote_code")
    return model.to(device).eval(), tokenizer


def read_text(args) -> str:
    """The text to score: ``--file``, or the ``--dataset`` rows joined by ``--join`` (ValueError if unavailable)."""
    if args.file:
        p = Path(args.file)
        if not p.is_file():
            raise ValueError(f"--file {args.file!r} does not exist or is not a file")
        return p.read_text(encoding="utf-8")
    import datasets

    try:
        ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    except Exception as exc:
        raise ValueError(f"could not load dataset {args.dataset!r} config {args.dataset_config!r} split "
                         f"{args.split!r} ({type(exc).__name__}: {exc}). Offline? use --file PATH instead")
    if args.text_column not in ds.column_names:
        raise ValueError(f"dataset has no column {args.text_column!r} (columns: {ds.column_names}); "
                         "pass --text_column")
    return args.join.encode().decode("unicode_escape").join(ds[args.text_column])


def format_table(results: dict) -> str:
    cols = ["mode", "tokens", "words", "bytes", "token_ppl", "word_ppl", "bits_per_byte"]
    rows = [[m, str(r["tokens"]), str(r["words"]), str(r["bytes"]), f"{r['token_perplexity']:.4f}",
             f"{r['word_perplexity']:.4f}", f"{r['bits_per_byte']:.5f}"] for m, r in results.items()]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (save_pretrained) of any causal LM")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the checkpoint)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", help="a UTF-8 text file, scored as one text")
    src.add_argument("--dataset", help="datasets.load_dataset name (needs network or a local cache)")
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--split", default="test")
    p.add_argument("--text_column", default="text")
    p.add_argument("--join", default=r"\n\n", help=r"separator joining dataset rows (default '\n\n', as in HF's guide)")
    p.add_argument("--mode", choices=["streaming", "strided", "rolling", "both"], default="streaming",
                   help="streaming: recurrent state carried (exact, O(1) memory); strided: HF sliding windows "
                        "(--max_length/--stride); rolling: lm-eval's disjoint --max_length windows; "
                        "both: streaming + strided (streaming skipped with a note for attention models)")
    p.add_argument("--segment_len", type=int, default=512, help="streaming segment length (tokens)")
    p.add_argument("--max_length", type=int, default=1024, help="strided/rolling window length (tokens)")
    p.add_argument("--stride", type=int, default=512, help="strided step (tokens)")
    p.add_argument("--max_tokens", type=int, default=None, help="score only (about) the first N tokens: the text is cut there and re-tokenized (debugging)")
    p.add_argument("--allow_kv_cache", action="store_true",
                   help="allow streaming with an attention KV cache (memory grows with the text)")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = read_text(args)
        if not text.strip():
            raise ValueError("the input text is empty")
        model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, args.trust_remote_code,
                                                    args.dtype, args.device)
        modes = ["streaming", "strided"] if args.mode == "both" else [args.mode]
        if args.max_tokens:  # truncate by tokens, then recount words/bytes on the decoded prefix
            ids = encode_text(tokenizer, text)[: args.max_tokens + 1]
            text = tokenizer.decode(ids[1:].tolist())
        results = evaluate_text(model, tokenizer, text, modes, args.segment_len, args.max_length, args.stride,
                                allow_kv_cache=args.allow_kv_cache, skip_unsupported_streaming=args.mode == "both")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    payload = {"model": str(args.model), "source": args.file or f"{args.dataset}/{args.dataset_config}/{args.split}",
               "results": results}
    print(format_table(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
