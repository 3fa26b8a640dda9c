"""Offline datasets for the local lm-eval tasks (wikitext2_local, lambada_openai_local).

Data folder: ``data_dir`` from the task metadata (``lm_eval --metadata '{"data_dir": "DIR"}'``), else
$BILINEAR_LM_DATA_DIR; nothing is assumed when neither is given. Files used (``LAYOUT``):
``wikitext-2-raw/wiki.{valid,test}.raw`` (WikiText-2 raw, as in wikitext-2-raw-v1.zip) and
``lambada/lambada_test.jsonl`` (LAMBADA's OpenAI test set, one ``{"text": ...}`` per line). tests/data holds a
tiny public-domain stand-in in this layout (tests/data/make_data.py).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

DATA_ENV = "BILINEAR_LM_DATA_DIR"
LAYOUT = "wikitext-2-raw/wiki.valid.raw, wikitext-2-raw/wiki.test.raw and lambada/lambada_test.jsonl"
_TOP_HEADING = re.compile(r"^ = [^=].* = \n?$")  # " = Title = " (sections are " = = Section = = ")


def resolve_data_dir(path: str | os.PathLike | None = None) -> Path:
    """The data folder: ``path`` if given, else $BILINEAR_LM_DATA_DIR. Neither, or no such folder: a
    FileNotFoundError whose one-line message names what to set and the files the folder holds. (A plain
    FileNotFoundError: lm-eval imports this file by path, as a module of its own, so a class defined here would not
    be the one callers import.)"""
    given = path if path not in (None, "") else os.environ.get(DATA_ENV)
    if not given:
        raise FileNotFoundError(f"the local lm-eval tasks need their data folder: set {DATA_ENV}=DIR (or lm_eval "
                           f"--metadata '{{\"data_dir\": \"DIR\"}}'), DIR holding {LAYOUT}")
    d = Path(given).expanduser()
    if not d.is_dir():
        source = "data_dir" if path not in (None, "") else DATA_ENV
        raise FileNotFoundError(f"{source}={given}: no such directory; it must hold {LAYOUT}")
    return d


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the data folder ({DATA_ENV}, or data_dir in the task "
                                f"metadata) must hold {LAYOUT}")
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


def load_wikitext2(data_dir: str | None = None, **kwargs):
    """custom_dataset for wikitext2_local: DatasetDict(validation, test) with a ``page`` column. ``data_dir``: the
    data folder (default $BILINEAR_LM_DATA_DIR); other keyword arguments (the task's metadata) are ignored."""
    import datasets

    base = resolve_data_dir(data_dir) / "wikitext-2-raw"
    splits = {}
    for split, fname in (("validation", "wiki.valid.raw"), ("test", "wiki.test.raw")):
        raw = _need(base / fname).read_text(encoding="utf-8")
        splits[split] = datasets.Dataset.from_dict({"page": split_wikitext_articles(raw)})
    return datasets.DatasetDict(splits)


def load_lambada_openai(data_dir: str | None = None, **kwargs):
    """custom_dataset for lambada_openai_local: DatasetDict(test) with a ``text`` column. ``data_dir`` as for
    load_wikitext2."""
    import datasets

    path = _need(resolve_data_dir(data_dir) / "lambada" / "lambada_test.jsonl")
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
