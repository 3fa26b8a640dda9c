"""Offline datasets for the local lm-eval tasks (wikitext2_local, lambada_openai_local).

Data directory: $BILINEAR_LM_DATA_DIR, default ``../shared/data`` relative to the current directory (the repo
root in the README's commands). Files used:
``wikitext-2-raw/wiki.{valid,test}.raw`` and ``lambada/lambada_test.jsonl``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

DATA_ENV = "BILINEAR_LM_DATA_DIR"
DEFAULT_DATA_DIR = Path("..") / "shared" / "data"
_TOP_HEADING = re.compile(r"^ = [^=].* = \n?$")  # " = Title = " (sections are " = = Section = = ")


def data_dir() -> Path:
    d = Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR)
    if not d.is_dir():
        raise FileNotFoundError(f"data directory {d.resolve()} not found; set {DATA_ENV}=/path/to/shared/data")
    return d


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; set {DATA_ENV} to the directory holding "
                                "wikitext-2-raw/ and lambada/ (default ../shared/data)")
    return path


def split_wikitext_articles(raw: str) -> list[str]:
    """Split a raw WikiText file into articles, each starting at a top-level `` = Title = `` line
    (the documents of EleutherAI/wikitext_document_level). Whitespace-only text before the first
    heading is dropped."""
    pages, cur = [], []
    for line in raw.splitlines(keepends=True):
        if _TOP_HEADING.match(line) and cur:
            pages.append("".join(cur))
            cur = []
        cur.append(line)
    if cur:
        pages.append("".join(cur))
    return [p for p in pages if p.strip()]


def load_wikitext2(**kwargs):
    """custom_dataset for wikitext2_local: DatasetDict(validation, test) with a ``page`` column."""
    import datasets

    base = data_dir() / "wikitext-2-raw"
    splits = {}
    for split, fname in (("validation", "wiki.valid.raw"), ("test", "wiki.test.raw")):
        raw = _need(base / fname).read_text(encoding="utf-8")
        splits[split] = datasets.Dataset.from_dict({"page": split_wikitext_articles(raw)})
    return datasets.DatasetDict(splits)


def load_lambada_openai(**kwargs):
    """custom_dataset for lambada_openai_local: DatasetDict(test) with a ``text`` column."""
    import datasets

    path = _need(data_dir() / "lambada" / "lambada_test.jsonl")
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})})


def wikitext_detokenizer(doc):
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as _detok

    return _detok(doc)


def wikitext_process_results(doc, results):
    (loglikelihood,) = results
    # as lm-eval's wikitext: words and bytes counted on the original page, before detokenization
    words = len(re.split(r"\s+", doc["page"]))
    n_bytes = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
