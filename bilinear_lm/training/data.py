"""Data pipeline for train.py: load text, build/load a tokenizer, tokenize with `datasets.map`, pack into blocks.

Everything here is library glue: `datasets` loads and maps, `tokenizers` trains the BPE / builds the char
vocabulary, and the result is always a transformers `PreTrainedTokenizerFast` so it can be saved next to a
checkpoint and reloaded with `AutoTokenizer.from_pretrained`.

    raw = load_raw_text(train_file=DEFAULT_TRAIN_FILE, val_fraction=0.1)   # the Tiny Shakespeare text shipped here
    tok = build_tokenizer("char", raw["train"])
    blocks = tokenize_and_pack(raw, tok, block_size=64)   # DatasetDict of {"input_ids"} rows, cached on disk

Data scales: files are checked in chunks, tokenizing runs in `num_proc` worker processes into the `datasets` cache
(memory-mapped Arrow files, reused by the next run and by the other ranks), packing cuts those rows into blocks a
batch at a time (`_Packer`: the remainder is carried over), and `streaming=True` reads, tokenizes and packs a
training corpus as it is iterated (resumable position: `IterableDataset.state_dict()`).
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, IterableDataset, concatenate_datasets
from datasets.fingerprint import Hasher

from .config import default_num_proc


class DataError(ValueError):
    """Unusable training data or tokenizer input (missing or empty file, unreachable hub, ...); the message says
    what to pass instead. CLIs print it as one line."""


# Tiny Shakespeare (40,000 lines, 1.1 MB; public domain), karpathy/char-rnn's data/tinyshakespeare/input.txt
# unchanged: train.py's data when it is given neither --dataset nor --train_file, so it runs anywhere offline.
DEFAULT_TRAIN_FILE = str(Path(__file__).parent / "default_data" / "tinyshakespeare.txt")
# file name ending -> the `datasets` builder that reads it (.gz files are decompressed by `datasets`)
FORMATS = {".txt": "text", ".raw": "text", ".text": "text", ".txt.gz": "text", ".jsonl": "json", ".json": "json",
           ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet"}
EOS_TOKEN = "<|endoftext|>"
VALIDATION_SPLITS = ("validation", "valid", "val")  # the names a dataset's held-out split goes by
PACK_ROWS = 100_000  # rows packed as one stream: small files pack as one contiguous stream (like nanoGPT)
PACK_TOKENS = 2 ** 20  # tokens per packing batch (the stream is cut a batch at a time, the remainder carried over)
# Characters per tokenizing batch: the tokenizer's per-token objects of a batch (ids, offsets, token strings) are
# ~100 bytes a token, so a batch of whole books (datasets' default, 1,000 rows) held the Gutenberg split at ~45x its
# tokenized size (3.6 GB peak); batches of about 1M characters keep a tokenizing process within ~2x of it
# (docs/results.md, "Data at scale").
TOKENIZE_CHARS = 2 ** 20
CHUNK = 1 << 20      # bytes per read when checking a file


# --------------------------------------------------------------------------------------------- loading
def _format(path: str | Path) -> str | None:
    """The FORMATS key `path` ends with (None: unsupported)."""
    name = Path(path).name.lower()
    return max((ext for ext in FORMATS if name.endswith(ext)), key=len, default=None)


def _data_files(path: str, what: str) -> list[str]:
    """`path` (a file, or a folder: its supported files, sorted) as the list of files to load."""
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and _format(f) and not f.name.startswith("."))
        if not files:
            raise DataError(f"{what} {path!r} is a folder without data files; it must hold files ending in "
                            f"{', '.join(FORMATS)}")
        return files
    if not p.is_file():
        raise DataError(f"{what} {path!r} does not exist (resolved to {p.resolve()}); check the path")
    if _format(p) is None:
        raise DataError(f"unsupported data file extension {''.join(p.suffixes[-2:]) or p.name!r} for {path}: pass "
                        f"a file (or a folder of files) ending in {', '.join(FORMATS)}")
    return [path]


def _check_file(path: str, what: str) -> None:
    """A readable file of its format with some text in it, else a DataError naming the file, where it goes wrong and
    the fix. Text formats are read once in CHUNK-sized pieces: UTF-8 (the byte offset of the first bad byte), no
    NUL byte, not only whitespace, and for JSON lines one JSON value per line (the line number)."""
    fmt = _format(path)
    if fmt == ".parquet":
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - any unreadable parquet is the same user error
            raise DataError(f"{what} {path!r} is not a readable Parquet file ({str(err).splitlines()[0]}); pass a "
                            f"Parquet file with a text column") from None
        return
    if fmt == ".json" and _check_json_document(path, what):
        return
    opener = gzip.open if fmt.endswith(".gz") else open
    decoder = codecs.getincrementaldecoder("utf-8")()
    json_lines = "json" in fmt
    offset, line_number, line, has_text = 0, 1, "", False
    try:
        with opener(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                pending = decoder.getstate()[0]  # the start of a character cut by the previous chunk
                try:
                    text = decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    raise DataError(f"{what} {path!r} is not UTF-8 text: byte 0x{(pending + chunk)[err.start]:02x} "
                                    f"at offset {offset - len(pending) + err.start} ({err.reason}); pass a text "
                                    f"file, or convert it (e.g. iconv -f LATIN1 -t UTF-8)") from None
                if b"\0" in chunk:
                    raise DataError(f"{what} {path!r} is binary, not text: a NUL byte at offset "
                                    f"{offset + chunk.index(0)}; pass a text file")
                has_text = has_text or (text.strip() != "")
                if json_lines:
                    *lines, line = (line + text).split("\n")
                    for number, complete in enumerate(lines, line_number):
                        _check_json_line(complete, number, path, what)
                    line_number += len(lines)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:  # the file ends inside a character
        raise DataError(f"{what} {path!r} is not UTF-8 text: it ends inside a character ({err.reason}); pass a text "
                        f"file, or convert it (e.g. iconv -f LATIN1 -t UTF-8)") from None
    except (OSError, EOFError) as err:  # e.g. a .gz file that is not gzip, or is truncated
        raise DataError(f"{what} {path!r} cannot be read ({err}); pass an intact {fmt} file") from None
    if json_lines:
        _check_json_line(line, line_number, path, what)
    if not has_text:
        raise DataError(f"{what} {path!r} is empty; it must contain text to train on")


def _check_json_line(line: str, number: int, path: str, what: str) -> None:
    try:
        if line.strip():
            json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{what} {path!r}, line {number}: not valid JSON ({err.msg}, column {err.colno}); every line "
                        f"of a JSON lines file is one JSON object, e.g. {{\"text\": \"...\"}}") from None


def _check_json_document(path: str, what: str) -> bool:
    """A .json file that is one JSON document: True when it parses (read whole, as `datasets` reads it), a DataError
    when it is broken; False when it is JSON lines instead (one value per line: checked as such)."""
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
        return True
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" or not err.doc.strip():  # JSON lines, or empty: the chunked check says which
            return False
        raise DataError(f"{what} {path!r}: not valid JSON ({err.msg}, line {err.lineno} column {err.colno}); a .json "
                        f"file is one JSON document, e.g. [{{\"text\": \"...\"}}, ...], or one object per line") from None
    except UnicodeDecodeError:
        return False  # reported with its byte offset by the chunked check


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


def builder_for(path: str, what: str = "training file", files: list[str] | None = None) -> str:
    """The `datasets` builder (text, json, parquet) that reads `path`, a file or a folder of files of one format."""
    builders = {FORMATS[_format(name)] for name in files or _data_files(path, what)}
    if len(builders) != 1:
        raise DataError(f"{what} {path!r} mixes formats ({', '.join(sorted(builders))}); a folder's files must all "
                        f"be text, JSON or Parquet")
    return builders.pop()


def _load_file(path: str, what: str, streaming: bool) -> Dataset | IterableDataset:
    """One split from a file or folder (FORMATS), each file checked first."""
    files = _data_files(path, what)
    builder = builder_for(path, what, files)
    for name in files:
        _check_file(name, what)
    kwargs = {"keep_linebreaks": True} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kwargs)
    except datasets.exceptions.DatasetGenerationError as err:  # e.g. JSON values that are not objects
        cause = err.__cause__ or err
        raise DataError(f"{what} {path!r} cannot be read as {builder} ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0][:200]}); every row must be an object with a text field, e.g. "
                        f"{{\"text\": \"...\"}}") from None


def load_raw_text(
    dataset: str | None = None,
    dataset_config: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str = "text",
    val_fraction: float = 0.1,
    streaming: bool = False,
) -> DatasetDict:
    """Return DatasetDict(train=..., validation=...) with a single `text` column.

    Local files (a file or a folder of them, FORMATS) win over `dataset`. Without a validation split the LAST
    `val_fraction` of the training characters becomes validation (exactly nanoGPT's prepare.py split for a single
    text file). With `streaming` the train split is a `datasets.IterableDataset` read as it is iterated (the
    validation split, which must then exist, is loaded as usual).
    """
    if train_file:
        raw = {"train": _load_file(train_file, "training file", streaming)}
    elif dataset:
        if not Path(dataset).exists() and not hub_reachable():
            # a cached copy may still exist: only try it when the user explicitly asked for offline mode
            if offline_mode():
                try:
                    raw = datasets.load_dataset(dataset, dataset_config, streaming=streaming)
                except Exception as err:  # noqa: BLE001 - re-raised with the fix
                    raise DataError(_offline_help(dataset, text_column)) from err
            else:
                raise DataError(_offline_help(dataset, text_column))
        else:
            raw = datasets.load_dataset(dataset, dataset_config, streaming=streaming)
        held_out = next((s for s in VALIDATION_SPLITS if s in raw), None)
        if streaming and held_out and not validation_file:  # small: loaded as usual (cached, random access)
            raw = {**raw, held_out: datasets.load_dataset(dataset, dataset_config, split=held_out)}
    else:
        raise DataError("no training data: pass --dataset NAME (HuggingFace hub) or --train_file PATH (a file or a "
                        "folder of files)")

    if "train" not in raw:
        raise DataError(f"dataset has no 'train' split (splits: {list(raw)})")
    columns = raw["train"].column_names
    if columns is not None and text_column not in columns:
        raise DataError(f"text column {text_column!r} not found (columns: {columns}); pass --text_column")
    if validation_file:
        raw["validation"] = _load_file(validation_file, "validation file", streaming=False)
    out = DatasetDict({"train": raw["train"].select_columns([text_column])})
    val_name = next((s for s in VALIDATION_SPLITS if s in raw), None)
    if val_name is None and streaming:
        raise DataError("--streaming needs a validation split (carving --val_fraction off a stream would need its "
                        "length): pass --validation_file, or a --dataset with a validation split")
    if val_name is None:
        out["train"], out["validation"] = carve_validation(out["train"], val_fraction, text_column)
    else:
        out["validation"] = raw[val_name].select_columns([text_column])
    if text_column != "text":
        out = DatasetDict({split: ds.rename_column(text_column, "text") for split, ds in out.items()})
    if not streaming and _n_chars(out["train"]) == 0:
        raise DataError("training data contains no text")
    return out


def _char_lengths(ds: Dataset, text_column: str = "text") -> np.ndarray:
    """Characters per row, computed by Arrow (no Python strings)."""
    return pc.utf8_length(ds.with_format("arrow")[text_column]).to_numpy(zero_copy_only=False)


def _n_chars(ds: Dataset, text_column: str = "text") -> int:
    return int(_char_lengths(ds, text_column).sum())


def carve_validation(ds: Dataset, val_fraction: float, text_column: str = "text") -> tuple[Dataset, Dataset]:
    """Split off the last `val_fraction` of the characters (splitting one row if needed)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ends = np.cumsum(_char_lengths(ds, text_column))  # characters up to and including each row
    cut = int(int(ends[-1]) * (1.0 - val_fraction)) if len(ends) else 0  # == nanoGPT: train = data[:int(n*0.9)]
    i = int(np.searchsorted(ends, cut, side="right"))  # the row that holds character `cut`
    if i >= len(ds):
        raise DataError("training data too small to carve a validation split; pass --validation_file")
    off = cut - (int(ends[i - 1]) if i else 0)
    row = ds[i][text_column]
    head = Dataset.from_dict({text_column: [row[:off]]}, features=ds.features)
    tail = Dataset.from_dict({text_column: [row[off:]]}, features=ds.features)
    train = concatenate_datasets([ds.select(range(i)), head]) if off else ds.select(range(i))
    val = concatenate_datasets([tail, ds.select(range(i + 1, len(ds)))]) if i + 1 < len(ds) else tail
    return train, val


# ------------------------------------------------------------------------------------------- tokenizer
def _iter_text(texts: Dataset | IterableDataset | list, batch: int = 1000) -> Iterator[list[str]]:
    """Batches of the `text` column of a dataset (or of several, one after the other), streamed."""
    for ds in texts if isinstance(texts, list) else [texts]:
        for rows in ds.iter(batch_size=batch):
            yield rows["text"]


def train_bpe_tokenizer(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, show_progress: bool = False,
                        length: int | None = None):
    """A byte-level BPE (lossless, no prefix space) trained with `tokenizers` on ``texts`` (strings, or batches
    of strings), as a `PreTrainedTokenizerFast` whose BOS, EOS and padding token is ``<|endoftext|>``. With
    ``show_progress`` the trainer draws its progress bars (on a terminal: reading ``length`` texts, counting pairs,
    merging)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def build_tokenizer(spec: str | None, train_text: Dataset | IterableDataset | list, vocab_size: int = 8192,
                    show_progress: bool = False):
    """`char` -> character vocabulary of the text (a dataset, or a list of them); None/"bpe" -> byte-level BPE
    trained with `tokenizers` on it (one pass, streamed; ``show_progress``: the trainer's progress bars);
    anything else -> AutoTokenizer.from_pretrained(spec) (local directory or hub name)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec == "char":
        chars = sorted(set().union(*(set("".join(batch)) for batch in _iter_text(train_text))))
        # BPE with no merges = one token per character; Fuse joins them back without spaces
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    if spec in (None, "", "bpe"):
        rows = sum(len(ds) for ds in (train_text if isinstance(train_text, list) else [train_text])
                   if isinstance(ds, Dataset)) or None  # the progress bar's total (a stream's is not known)
        return train_bpe_tokenizer(_iter_text(train_text), vocab_size, show_progress, length=rows)
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


# -------------------------------------------------------------------------------------- tokenize + pack
def tokenizing_rows(chars_per_row: float) -> int:
    """Rows per tokenizing batch, of the map-style and the streaming path alike: about TOKENIZE_CHARS characters
    (rows of `chars_per_row` characters on average), at most datasets' default of 1,000 rows."""
    return max(1, min(1000, int(TOKENIZE_CHARS / max(chars_per_row, 1.0))))


def _head_chars_per_row(ds: IterableDataset) -> float:
    """Characters per row at the head of a stream: its first rows up to TOKENIZE_CHARS characters (at most 1,000
    rows; the same rows on every rank and every resume), read once."""
    chars = rows = 0
    for rows, row in enumerate(ds.take(1000), 1):
        chars += len(row["text"])
        if chars >= TOKENIZE_CHARS:
            break
    return chars / max(rows, 1)


def _encoder(tokenizer):
    """The `tokenizers` backend of a transformers fast tokenizer, copied without truncation or padding (its call turns
    both off as well): the same ids as `tokenizer(texts, add_special_tokens=False)`, from `encode_batch_fast`, which
    skips the character offsets (about half the time of a byte-level BPE's encoding, measured on Gutenberg text)."""
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    return encoder


def _blocks(tokens: np.ndarray, block_size: int) -> pa.Table:
    """`tokens` (a whole number of blocks) as a table of `block_size` rows of `input_ids`, without a copy."""
    offsets = pa.array(np.arange(0, len(tokens) + 1, block_size, dtype=np.int32))
    return pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(tokens))})


def _pack(table: pa.Table, block_size: int) -> pa.Table:
    """The token rows of `table` as one stream cut into `block_size` blocks; the tail that fills no block is dropped."""
    flat = pc.list_flatten(table["input_ids"])
    n = len(flat) // block_size * block_size
    flat = flat.slice(0, n)
    flat = flat.combine_chunks() if isinstance(flat, pa.ChunkedArray) else flat
    return _blocks(flat.to_numpy(), block_size)


class _Packer:
    """A `datasets.map` function (batched, with_indices, Arrow format, in one process) that cuts the token rows of a
    split, batch after batch, into `block_size` blocks and carries the tokens that fill no whole block over to the
    next batch. The blocks are those of packing every PACK_ROWS rows as one stream (`_pack`), whose tail under a
    block is dropped, while only one batch of tokens is held: batches hold a divisor of PACK_ROWS rows, so none
    straddles two packing groups, and the carry is dropped where a group starts."""

    def __init__(self, block_size: int):
        self.block_size, self.carry, self.next_row = block_size, np.empty(0, np.int32), 0

    def __call__(self, batch: pa.Table, indices: list[int]) -> pa.Table:
        if indices[0] % PACK_ROWS == 0:
            self.carry = self.carry[:0]
        elif indices[0] != self.next_row:  # the carry belongs to the rows just before: batches must come in order
            raise RuntimeError(f"packing batch at row {indices[0]}, expected row {self.next_row}")
        self.next_row = indices[-1] + 1
        flat = pc.list_flatten(batch["input_ids"])
        tokens = np.concatenate([self.carry, flat.to_numpy() if len(flat) else np.empty(0, np.int32)])
        n = len(tokens) // self.block_size * self.block_size
        self.carry = tokens[n:].copy()  # not a view that would keep this batch's tokens alive
        return _blocks(tokens[:n], self.block_size)


def _packing_rows(row_tokens: np.ndarray) -> int:
    """Rows per packing batch: about PACK_TOKENS tokens, and a divisor of PACK_ROWS."""
    target = max(1, min(PACK_ROWS, int(PACK_TOKENS / max(float(row_tokens.mean()) if len(row_tokens) else 1.0, 1.0))))
    return max(d for d in range(1, target + 1) if PACK_ROWS % d == 0)


def tokenize_and_pack(raw: DatasetDict, tokenizer, block_size: int, add_eos: bool = False,
                      num_proc: int | None = None) -> DatasetDict:
    """Tokenize every split with `.map` and pack the concatenated token stream into `block_size` rows of `input_ids`
    (int32; the training loader adds `labels`, equal to them: the model shifts them).

    Rows are concatenated as they are (.txt rows keep their line breaks); with `add_eos` the tokenizer's EOS id is
    appended to every row (document-per-row data such as .jsonl). Every PACK_ROWS rows are packed as one stream
    whose tail that does not fill a whole block is dropped. A map-style split is tokenized by `num_proc` worker
    processes (batches of about TOKENIZE_CHARS characters) into the `datasets` cache on disk, then packed by this
    process from those memory-mapped rows, about PACK_TOKENS tokens at a time (`_Packer`), into the cache too (a
    second call with the same text, tokenizer and options loads it from there); an `IterableDataset` split
    (streaming) is tokenized in batches of the same size and packed as it is iterated, each such batch as one stream
    (its tail under a block dropped): the same blocks where the data fit in one batch, and memory bounded by a batch
    for a stream of books.
    """
    eos = tokenizer.eos_token_id if add_eos else None
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})

    encoder = _encoder(tokenizer)

    def tokenize(batch):
        ids = [encoding.ids for encoding in encoder.encode_batch_fast(batch["text"], add_special_tokens=False)]
        return {"input_ids": [x + [eos] for x in ids] if eos is not None else ids}

    # the cache key: the text, the tokenizer's full definition and the options (not the hash of a closure)
    key = Hasher.hash([tokenizer.backend_tokenizer.to_str(), eos, block_size, PACK_ROWS])
    out = DatasetDict()
    for split, ds in raw.items():
        if isinstance(ds, IterableDataset):
            rows = tokenizing_rows(_head_chars_per_row(ds))
            toks = ds.map(tokenize, batched=True, batch_size=rows, remove_columns=["text"], features=features)
            # packed per tokenizing batch (~TOKENIZE_CHARS): a stream of books must not be read whole into one group
            out[split] = toks.with_format("arrow").map(_pack, batched=True, batch_size=rows,
                                                       fn_kwargs={"block_size": block_size}).with_format(None)
            continue
        rows = tokenizing_rows(_n_chars(ds) / max(len(ds), 1))
        # worker processes (one-threaded tokenizers: datasets sets TOKENIZERS_PARALLELISM=false in them), num_proc 1
        # too: the worker's exit hands back the tokenizer's memory, which this process's allocator would keep
        toks = ds.map(tokenize, batched=True, batch_size=rows, writer_batch_size=rows, remove_columns=ds.column_names,
                      features=features, num_proc=num_proc or default_num_proc(),
                      new_fingerprint=Hasher.hash([ds._fingerprint, key]), desc=f"tokenize {split}")
        row_tokens = pc.list_value_length(toks.with_format("arrow")["input_ids"]).to_numpy()
        if row_tokens.sum() < block_size:
            raise DataError(
                f"the {split} split has only {row_tokens.sum()} tokens, fewer than block_size={block_size}; "
                f"use a smaller --block_size or more data"
            )
        out[split] = toks.with_format("arrow").map(_Packer(block_size), batched=True, with_indices=True,
                                                   batch_size=_packing_rows(row_tokens), desc=f"pack {split}",
                                                   new_fingerprint=Hasher.hash([toks._fingerprint, "pack", key])
                                                   ).with_format(None)
    return out
