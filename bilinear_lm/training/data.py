"""Data pipeline for train.py: load text, build/load a tokenizer, tokenize with `datasets.map`, pack into blocks.

Everything here is library glue: `datasets` loads and maps, `tokenizers` trains the BPE / builds the char
vocabulary, and the result is always a transformers `PreTrainedTokenizerFast` so it can be saved next to a
checkpoint and reloaded with `AutoTokenizer.from_pretrained`.

    raw = load_raw_text(train_file=DEFAULT_TRAIN_FILE, val_fraction=0.1)   # the Tiny Shakespeare text shipped here
    tok = build_tokenizer("char", raw["train"])
    blocks = tokenize_and_pack(raw, tok, block_size=64)   # DatasetDict of {"input_ids", "labels"} rows
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator

import datasets
from datasets import Dataset, DatasetDict, concatenate_datasets


class DataError(ValueError):
    """Unusable training data or tokenizer input (missing or empty file, unreachable hub, ...); the message says
    what to pass instead. CLIs print it as one line."""


# Tiny Shakespeare (40,000 lines, 1.1 MB; public domain), karpathy/char-rnn's data/tinyshakespeare/input.txt
# unchanged: train.py's data when it is given neither --dataset nor --train_file, so it runs anywhere offline.
DEFAULT_TRAIN_FILE = str(Path(__file__).parent / "default_data" / "tinyshakespeare.txt")
TEXT_EXTENSIONS = {".txt": "text", ".raw": "text", ".text": "text", ".jsonl": "json", ".json": "json"}
EOS_TOKEN = "<|endoftext|>"


# --------------------------------------------------------------------------------------------- loading
def _builder_for(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in TEXT_EXTENSIONS:
        raise DataError(
            f"unsupported data file extension {suffix!r} for {path}: use a .txt (one text, split by lines) "
            f"or .jsonl (one JSON object per line with a text field) file"
        )
    return TEXT_EXTENSIONS[suffix]


def _check_file(path: str, what: str) -> None:
    """A readable UTF-8 text file with some text in it (and, for .jsonl, one JSON value per line), else a DataError
    naming the file, where it goes wrong and the fix."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{what} {path!r} is a directory, not a file; pass a .txt or .jsonl file")
    if not p.is_file():
        raise DataError(f"{what} {path!r} does not exist (resolved to {p.resolve()}); check the path")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{what} {path!r} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start} "
                        f"({err.reason}); pass a text file, or convert it (e.g. iconv -f LATIN1 -t UTF-8)") from None
    if "\0" in text:
        raise DataError(f"{what} {path!r} is binary, not text: a NUL byte at offset {raw.index(0)}; pass a .txt "
                        f"or .jsonl text file")
    if not text.strip():
        raise DataError(f"{what} {path!r} is empty; it must contain text to train on")
    if p.suffix.lower() == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{what} {path!r}, line {number}: not valid JSON ({err.msg}, column {err.colno}); "
                                f"every line of a .jsonl file is one JSON object, e.g. {{\"text\": \"...\"}}") from None


def offline_mode() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set: only cached hub files may be used."""
    return any(os.environ.get(v, "0") not in ("0", "", "false", "False") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 5.0) -> bool:
    """Cheap connectivity probe so an offline machine fails in seconds instead of retrying for minutes."""
    if offline_mode():
        return False
    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
        return True
    except urllib.error.HTTPError:
        return True  # the server answered
    except Exception:
        return False


def _offline_help(dataset: str, text_column: str) -> str:
    return (
        f"cannot load dataset {dataset!r}: the HuggingFace Hub is unreachable (no network, or HF_HUB_OFFLINE set) "
        f"and no cached copy was found. Train on local files instead (--train_file wins over --dataset): e.g. "
        f"--train_file stories.txt (read line by line), or --train_file train.jsonl --validation_file "
        f"validation.jsonl (a '{text_column}' field on every line); with neither --dataset nor --train_file, "
        f"train.py trains on the Tiny Shakespeare text shipped with the package"
    )


def load_raw_text(
    dataset: str | None = None,
    dataset_config: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str = "text",
    val_fraction: float = 0.1,
) -> DatasetDict:
    """Return DatasetDict(train=..., validation=...) with a single `text` column.

    Local files win over `dataset`. Without a validation split the LAST `val_fraction` of the training
    characters becomes validation (exactly nanoGPT's prepare.py split for a single text file).
    """
    if train_file:
        _check_file(train_file, "training file")
        files = {"train": train_file}
        if validation_file:
            _check_file(validation_file, "validation file")
            files["validation"] = validation_file
        builders = {_builder_for(f) for f in files.values()}
        if len(builders) != 1:
            raise DataError("--train_file and --validation_file must have the same format (.txt or .jsonl)")
        builder = builders.pop()
        kwargs = {"keep_linebreaks": True} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **kwargs)
    elif dataset:
        if not Path(dataset).exists() and not hub_reachable():
            # a cached copy may still exist: only try it when the user explicitly asked for offline mode
            if offline_mode():
                try:
                    raw = datasets.load_dataset(dataset, dataset_config)
                except Exception as err:  # noqa: BLE001 - re-raised with the fix
                    raise DataError(_offline_help(dataset, text_column)) from err
            else:
                raise DataError(_offline_help(dataset, text_column))
        else:
            raw = datasets.load_dataset(dataset, dataset_config)
        if validation_file:
            _check_file(validation_file, "validation file")
            builder = _builder_for(validation_file)
            raw["validation"] = datasets.load_dataset(
                builder, data_files=validation_file, split="train", **({"keep_linebreaks": True} if builder == "text" else {})
            )
    else:
        raise DataError("no training data: pass --dataset NAME (HuggingFace hub) or --train_file PATH (.txt/.jsonl)")

    if "train" not in raw:
        raise DataError(f"dataset has no 'train' split (splits: {list(raw)})")
    if text_column not in raw["train"].column_names:
        raise DataError(
            f"text column {text_column!r} not found (columns: {raw['train'].column_names}); pass --text_column"
        )
    out = DatasetDict({"train": raw["train"].select_columns([text_column])})
    val_name = next((s for s in ("validation", "valid", "val") if s in raw), None)
    if val_name is not None:
        out["validation"] = raw[val_name].select_columns([text_column])
    else:
        out["train"], out["validation"] = carve_validation(out["train"], val_fraction, text_column)
    if text_column != "text":
        out = out.rename_column(text_column, "text")
    if sum(len(t) for t in out["train"]["text"]) == 0:
        raise DataError("training data contains no text")
    return out


def carve_validation(ds: Dataset, val_fraction: float, text_column: str = "text") -> tuple[Dataset, Dataset]:
    """Split off the last `val_fraction` of the characters (splitting one row if needed)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    texts = ds[text_column]
    total = sum(len(t) for t in texts)
    cut = int(total * (1.0 - val_fraction))  # == nanoGPT: train = data[:int(n*0.9)]
    seen = 0
    for i, t in enumerate(texts):
        if seen + len(t) > cut:
            break
        seen += len(t)
    else:
        raise DataError("training data too small to carve a validation split; pass --validation_file")
    off = cut - seen
    head = Dataset.from_dict({text_column: [texts[i][:off]]})
    tail = Dataset.from_dict({text_column: [texts[i][off:]]})
    train = concatenate_datasets([ds.select(range(i)), head]) if off else ds.select(range(i))
    val = concatenate_datasets([tail, ds.select(range(i + 1, len(ds)))]) if i + 1 < len(ds) else tail
    return train, val


# ------------------------------------------------------------------------------------------- tokenizer
def _iter_text(ds: Dataset, batch: int = 1000) -> Iterator[list[str]]:
    for i in range(0, len(ds), batch):
        yield ds[i : i + batch]["text"]


def train_bpe_tokenizer(texts: Iterable[str] | Iterable[list[str]], vocab_size: int):
    """A byte-level BPE (lossless, no prefix space) trained with `tokenizers` on ``texts`` (strings, or batches
    of strings), as a `PreTrainedTokenizerFast` whose BOS, EOS and padding token is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def build_tokenizer(spec: str | None, train_text: Dataset, vocab_size: int = 8192):
    """`char` -> character vocabulary of the training text; None/"bpe" -> byte-level BPE trained with
    `tokenizers`; anything else -> AutoTokenizer.from_pretrained(spec) (local directory or hub name)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec == "char":
        chars = sorted(set().union(*(set(t) for t in _iter_text_flat(train_text))))
        # BPE with no merges = one token per character; Fuse joins them back without spaces
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    if spec in (None, "", "bpe"):
        return train_bpe_tokenizer(_iter_text(train_text), vocab_size)
    looks_local = os.sep in spec or spec.startswith(".") or Path(spec).exists()
    if looks_local and not Path(spec).is_dir():
        raise DataError(
            f"tokenizer path {spec!r} is not a directory; pass a directory written by save_pretrained, a hub "
            f"name, 'char', or omit --tokenizer to train a byte-level BPE"
        )
    if not looks_local and not offline_mode() and not hub_reachable():
        raise DataError(
            f"tokenizer {spec!r} is not a local directory and the HuggingFace Hub is unreachable; pass a local "
            f"directory written by save_pretrained, 'char', or omit --tokenizer to train a byte-level BPE"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except Exception as err:  # noqa: BLE001
        raise DataError(
            f"could not load tokenizer {spec!r} ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
            f"Pass a local directory written by save_pretrained, a reachable hub name, 'char', or omit "
            f"--tokenizer to train a byte-level BPE on the training text"
        ) from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _iter_text_flat(ds: Dataset) -> Iterator[str]:
    for batch in _iter_text(ds):
        yield from batch


# -------------------------------------------------------------------------------------- tokenize + pack
def tokenize_and_pack(raw: DatasetDict, tokenizer, block_size: int, add_eos: bool = False) -> DatasetDict:
    """Tokenize every split with `.map` and pack the concatenated token stream into `block_size` rows.

    Rows are concatenated as they are (.txt rows keep their line breaks); with `add_eos` the tokenizer's
    EOS id is appended to every row (document-per-row data such as .jsonl). The tail that does not fill
    a whole block is dropped. `labels` equal `input_ids`; the model shifts them.
    """
    eos = tokenizer.eos_token_id if add_eos else None

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = [x + [eos] for x in ids]
        return {"input_ids": ids}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = (len(flat) // block_size) * block_size
        blocks = [flat[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    out = DatasetDict()
    for split, ds in raw.items():
        toks = ds.map(tokenize, batched=True, remove_columns=ds.column_names, keep_in_memory=True,
                      desc=f"tokenize {split}")
        n_tokens = sum(len(x) for x in toks["input_ids"])
        if n_tokens < block_size:
            raise DataError(
                f"the {split} split has only {n_tokens} tokens, fewer than block_size={block_size}; "
                f"use a smaller --block_size or more data"
            )
        # 100k rows per packing batch: small files pack as one contiguous stream (like nanoGPT)
        out[split] = toks.map(group, batched=True, batch_size=100_000, remove_columns=toks.column_names,
                              keep_in_memory=True, desc=f"pack {split}")
    return out
