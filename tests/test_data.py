"""Data pipeline and config parsing of train.py, against independent references (plain slicing / loops)."""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bilinear_lm.training import data as D
from bilinear_lm.training import TrainingInputError, parse_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shakespeare_raw():
    path = Path(D.DEFAULT_TRAIN_FILE)
    return path, D.load_raw_text(train_file=str(path), val_fraction=0.1)


def test_the_shipped_default_text_is_tiny_shakespeare():
    """karpathy/char-rnn's data/tinyshakespeare/input.txt byte for byte (its SHA-256 as the data folder's README
    lists it)."""
    digest = hashlib.sha256(Path(D.DEFAULT_TRAIN_FILE).read_bytes()).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_split_matches_nanogpt_prepare(shakespeare_raw):
    path, raw = shakespeare_raw
    text = path.read_text()
    n = len(text)
    assert "".join(raw["train"]["text"]) == text[: int(n * 0.9)]  # nanoGPT shakespeare_char/prepare.py
    assert "".join(raw["validation"]["text"]) == text[int(n * 0.9) :]


def test_char_tokenizer_and_packing_match_reference(shakespeare_raw, tmp_path):
    from transformers import AutoTokenizer

    path, raw = shakespeare_raw
    text = path.read_text()
    tok = D.build_tokenizer("char", raw["train"])
    chars = sorted(set(text))  # nanoGPT's vocabulary
    stoi = {c: i for i, c in enumerate(chars)}
    assert len(tok) == len(chars) == 65
    sample = text[:500]
    assert tok(sample, add_special_tokens=False)["input_ids"] == [stoi[c] for c in sample]
    assert tok.decode([stoi[c] for c in sample]) == sample
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(sample)["input_ids"] == [stoi[c] for c in sample]

    small = D.load_raw_text(train_file=str(_write(tmp_path / "s.txt", text[:20000])), val_fraction=0.1)
    blocks = D.tokenize_and_pack(small, tok, block_size=64)
    ref = [stoi[c] for c in text[:18000]]
    n_blocks = len(ref) // 64
    assert list(blocks["train"]["input_ids"]) == [ref[i * 64 : (i + 1) * 64] for i in range(n_blocks)]
    assert blocks["train"].column_names == ["input_ids"]  # the loader adds labels (bilinear_lm.training.collate)
    val_ref = [stoi[c] for c in text[18000:20000]]
    assert list(blocks["validation"]["input_ids"]) == [val_ref[i * 64 : (i + 1) * 64] for i in range(len(val_ref) // 64)]


def _write(path, text):
    path.write_text(text)
    return path


def test_bpe_tokenizer_trained_roundtrip(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 50 + "Ünïcödé ✓\n"
    raw = D.load_raw_text(train_file=str(_write(tmp_path / "t.txt", text * 3)))
    tok = D.build_tokenizer(None, raw["train"], vocab_size=300)
    assert len(tok) == 300 and tok.eos_token == D.EOS_TOKEN
    ids = tok("the lazy fox ✓ never seen: ZQX", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "the lazy fox ✓ never seen: ZQX"  # byte-level: no unknown tokens
    assert len(tok("the quick brown fox")["input_ids"]) < len("the quick brown fox") / 2  # merges learned


def test_jsonl_documents_get_eos_between_them(tmp_path):
    docs = [{"text": f"document number {i} " * 20} for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    raw = D.load_raw_text(train_file=str(path), val_fraction=0.25)
    assert "".join(list(raw["train"]["text"]) + list(raw["validation"]["text"])) == "".join(d["text"] for d in docs)
    tok = D.build_tokenizer(None, raw["train"], vocab_size=280)
    blocks = D.tokenize_and_pack(raw, tok, block_size=16, add_eos=True)
    flat = [t for b in blocks["train"]["input_ids"] for t in b]
    assert flat.count(tok.eos_token_id) >= 25


def test_bad_inputs_have_clear_errors(tmp_path, shakespeare_raw):
    with pytest.raises(D.DataError, match="does not exist"):
        D.load_raw_text(train_file=str(tmp_path / "missing.txt"))
    with pytest.raises(D.DataError, match="is empty"):
        D.load_raw_text(train_file=str(_write(tmp_path / "empty.txt", "\n\n")))
    with pytest.raises(D.DataError, match="unsupported data file extension"):
        D.load_raw_text(train_file=str(_write(tmp_path / "x.csv", "a,b")))
    tiny = D.load_raw_text(train_file=str(_write(tmp_path / "tiny.txt", "hello world, this is tiny\n")))
    tok = D.build_tokenizer("char", tiny["train"])
    with pytest.raises(D.DataError, match="fewer than block_size=64"):
        D.tokenize_and_pack(tiny, tok, block_size=64)
    with pytest.raises(D.DataError, match="tokenizer path .* is not a directory"):
        D.build_tokenizer(str(tmp_path / "no_such_tokenizer"), tiny["train"])


def test_unreachable_hub_fails_fast_with_local_file_hint(monkeypatch):
    monkeypatch.setattr(D, "hub_reachable", lambda timeout=5.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    t0 = time.time()
    with pytest.raises(D.DataError, match="(?s)Hub is unreachable.*--train_file"):  # an exception, not SystemExit
        D.load_raw_text(dataset="wikitext", dataset_config="wikitext-2-raw-v1")
    assert time.time() - t0 < 5
    with pytest.raises(D.DataError, match="tokenizer 'gpt2' is not a local directory and the HuggingFace Hub is unreachable"):
        D.build_tokenizer("gpt2", None)


# ---------------------------------------------------------------------------------------- config parsing
def test_config_preset_and_overrides_are_typed():
    cfg = parse_config(["--config", str(REPO / "bilinear_lm/configs/shakespeare-char.yaml"), "--max_steps", "7",
                        "--learning_rate=3e-3", "--model.num_hidden_layers", "2", "--tokenizer", "bpe",
                        "--model.use_mlp", "false", "--model.mixer_type", "diagonal"])
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.learning_rate == 3e-3 and cfg.data.tokenizer == "bpe"
    assert cfg.data.block_size == 64 and cfg.train.batch_size == 12  # from the preset
    assert cfg.model["num_hidden_layers"] == 2 and cfg.model["state_size"] == 48
    assert cfg.model["use_mlp"] is False and cfg.model["mixer_type"] == "diagonal"
    with pytest.raises(TrainingInputError, match="invalid int value: 'many'"):
        parse_config(["--max_steps", "many"])


def test_config_unknown_keys_name_the_valid_ones(tmp_path):
    with pytest.raises(TrainingInputError, match=r"unknown argument '--max_stepz' \(did you mean --max_steps\?\)"):
        parse_config(["--max_stepz", "3"])
    with pytest.raises(TrainingInputError, match="unknown model key 'hiden_size'.*hidden_size"):
        parse_config(["--model.hiden_size", "3"])
    bad = _write(tmp_path / "bad.yaml", "max_steps: 3\nlearning_rat: 0.1\n")
    with pytest.raises(TrainingInputError, match=r"preset .*bad.yaml: unknown argument '--learning_rat' \(did you "
                                                 r"mean --learning_rate\?\)"):
        parse_config(["--config", str(bad)])


def test_all_presets_parse_and_build():
    """Every preset is valid and names no local file (they run anywhere: the shipped text, or a Hub dataset); the
    125m preset is ~125M parameters (meta device: no memory)."""
    import torch

    from bilinear_lm.baselines import build_model, count_parameters

    presets = sorted((REPO / "bilinear_lm/configs").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"tiny", "shakespeare-char", "tinystories", "125m"}
    for p in presets:
        cfg = parse_config(["--config", str(p)])
        assert cfg.data.train_file is None and cfg.data.validation_file is None, p.stem
        with torch.device("meta"):
            n = count_parameters(build_model("bilinear", cfg.model, vocab_size=50257 if p.stem == "125m" else 4096))
        if p.stem == "125m":
            assert 100e6 < n < 150e6


# ------------------------------------------------------------------------------------ saved tokenizer
LOADS = [("import bilinear_lm", "AutoTokenizer.from_pretrained(CKPT)"),
         ("", "AutoTokenizer.from_pretrained(CKPT, trust_remote_code=True)")]


@pytest.fixture(scope="module", autouse=True)
def tokenizer_loads(tmp_path_factory):
    """The saved-tokenizer tests' processes (stdin closed), started at module start while the other tests run: each
    of LOADS on a checkpoint as train.py writes it (the tiny model + its BPE in one folder, ROOT/ckpt), and "alone",
    a bare AutoTokenizer.from_pretrained of a hybrid's (ROOT/hybrid) in a process that never imports bilinear_lm."""
    from bilinear_lm import BilinearConfig, BilinearForCausalLM
    from bilinear_lm.modeling.configuration_bilinear import interleaved_layer_types
    from conftest import TINY_CONFIG

    root = tmp_path_factory.mktemp("tokenizer_loads")
    text = D.load_raw_text(train_file=str(_write(root / "t.txt", "hello world, a tiny text\n" * 50)))
    tok = D.build_tokenizer(None, text["train"], vocab_size=280)
    hybrid = BilinearConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_heads=2, state_size=4,
                            rank=4, num_attention_heads=2, layer_types=interleaved_layer_types(2, 2))
    for name, config in (("ckpt", BilinearConfig(**{**TINY_CONFIG, "vocab_size": len(tok)})), ("hybrid", hybrid)):
        BilinearForCausalLM(config).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    codes = {(setup, load): (f"{setup}\nfrom transformers import AutoTokenizer\nCKPT = {str(root / 'ckpt')!r}\n"
                             f"tok = {load}\nprint('ROUNDTRIP', tok.decode(tok('hello world').input_ids) == "
                             f"'hello world', tok.eos_token)", REPO) for setup, load in LOADS}
    codes["alone"] = (f"import sys\nfrom transformers import AutoTokenizer\ntok = AutoTokenizer.from_pretrained("
                      f"{str(root / 'hybrid')!r})\nassert 'bilinear_lm' not in sys.modules\n"
                      "print('ROUNDTRIP', tok.decode(tok('hello world').input_ids) == 'hello world', len(tok))", root)
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=cwd,
                                    env={**os.environ, "HF_HUB_OFFLINE": "1"}) for name, (code, cwd) in codes.items()}
    yield SimpleNamespace(root=root, vocab=len(tok), procs=procs)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("setup,load", LOADS)
def test_tokenizer_saved_with_the_model_loads_without_questions(setup, load, tokenizer_loads):
    """A checkpoint as train.py writes it (model + its BPE in one folder): with bilinear_lm imported, or with
    trust_remote_code=True, AutoTokenizer neither asks y/N (stdin closed) nor warns about the model type, and
    round-trips text. (A bare AutoTokenizer.from_pretrained(CKPT) in a process that never imported
    bilinear_lm asks on a terminal: transformers 5.23 resolves the model config, remote code, before
    tokenizer_config.json; without an answer it loads, next test.)"""
    proc = tokenizer_loads.procs[setup, load]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"ROUNDTRIP True {D.EOS_TOKEN}" in out
    assert "[y/N]" not in out + err and "to instantiate a model of type" not in err


def test_the_saved_tokenizer_loads_alone_in_a_process_that_never_imports_bilinear_lm(tokenizer_loads):
    """A bare AutoTokenizer.from_pretrained(CKPT), no answer to transformers' y/N (stdin closed): it falls back to
    reading config.json as a plain PreTrainedConfig, which refused the layer type "bilinear" (`layer_types` entries
    must be in (...)) before it looked at the tokenizer's files; config.json names it "linear_attention" now. A
    hybrid: its attention layers keep their names."""
    from bilinear_lm import BilinearConfig

    proc, ckpt = tokenizer_loads.procs["alone"], tokenizer_loads.root / "hybrid"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"ROUNDTRIP True {tokenizer_loads.vocab}" in out
    assert json.loads((ckpt / "config.json").read_text())["layer_types"] == ["linear_attention", "full_attention"]
    assert BilinearConfig.from_pretrained(ckpt).layer_types == ["bilinear", "full_attention"]


def test_bpe_training_shows_the_trainers_progress_when_asked(monkeypatch):
    """train.py asks on a terminal (the trainer's bars; in a log they are blank lines): the bars count the texts read
    (`length`), then the pairs and merges."""
    from datasets import Dataset
    from tokenizers import trainers

    made, bpe_trainer = [], trainers.BpeTrainer

    def recording(**kwargs):
        made.append(kwargs)
        return bpe_trainer(**kwargs)

    monkeypatch.setattr(trainers, "BpeTrainer", recording)
    texts = [Dataset.from_dict({"text": ["the quick brown fox"] * 30}), Dataset.from_dict({"text": ["jumps"] * 5})]
    assert len(D.build_tokenizer("bpe", texts, vocab_size=270, show_progress=True)) <= 270
    D.build_tokenizer("bpe", texts, vocab_size=270)
    assert [m["show_progress"] for m in made] == [True, False]


# ------------------------------------------------------------------------------ formats, cache, streaming
DOCS = [f"Document {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog.\n" for i in range(60)]


def _char_tokenizer():
    from datasets import Dataset

    return D.build_tokenizer("char", Dataset.from_dict({"text": ["".join(DOCS)]}))


def _blocks(train_file, tok, streaming=False, **kwargs):
    raw = D.load_raw_text(train_file=str(train_file), validation_file=str(train_file), streaming=streaming, **kwargs)
    return D.tokenize_and_pack(raw, tok, block_size=16, num_proc=1)


def _rows(ds):
    return [list(row["input_ids"]) for row in ds]


def _write_formats(root):
    """DOCS as every supported format, and as a folder of two .jsonl files."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (root / "docs.jsonl").write_text(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (root / "docs.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    pq.write_table(pa.table({"text": DOCS}), root / "docs.parquet")
    (root / "folder").mkdir()
    (root / "folder" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:30]))
    (root / "folder" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[30:]))
    (root / "folder" / ".hidden.txt").write_text("not data")
    return ["docs.jsonl.gz", "docs.json", "docs.parquet", "folder"]


def test_every_format_and_a_folder_yield_the_same_blocks_as_jsonl(tmp_path):
    tok = _char_tokenizer()
    others = _write_formats(tmp_path)
    reference = _blocks(tmp_path / "docs.jsonl", tok)
    assert len(reference["train"]) > 10
    for name in others:
        blocks = _blocks(tmp_path / name, tok)
        assert _rows(blocks["train"]) == _rows(reference["train"]), name
    # a .txt file holding the same characters (a line per document) packs into the same blocks
    (tmp_path / "docs.txt").write_text("".join(DOCS))
    assert _rows(_blocks(tmp_path / "docs.txt", tok)["train"]) == _rows(reference["train"])


def test_streaming_packs_the_same_blocks_and_resumes_where_it_stopped(tmp_path):
    from torch.utils.data import DataLoader

    tok = _char_tokenizer()
    _write_formats(tmp_path)
    blocks = _blocks(tmp_path / "docs.jsonl", tok)["train"]
    stream = _blocks(tmp_path / "docs.jsonl", tok, streaming=True)["train"]
    assert _rows(stream) == _rows(blocks)

    def loader(ds):  # as train.py reads it
        return iter(DataLoader(ds, batch_size=3))

    stream = stream.with_format("torch")
    uninterrupted = [b["input_ids"].tolist() for b in loader(stream)]
    interrupted = loader(stream)
    first = [next(interrupted)["input_ids"].tolist() for _ in range(4)]
    state = json.loads(json.dumps(stream.state_dict()))  # as saved in a checkpoint
    resumed = _blocks(tmp_path / "docs.jsonl", tok, streaming=True)["train"].with_format("torch")
    resumed.load_state_dict(state)
    assert first + [b["input_ids"].tolist() for b in loader(resumed)] == uninterrupted


def test_tokenized_blocks_are_cached_on_disk_and_reused(tmp_path):
    tok = _char_tokenizer()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    raw = D.load_raw_text(train_file=str(tmp_path / "docs.jsonl"), val_fraction=0.2)
    first = D.tokenize_and_pack(raw, tok, block_size=16, num_proc=2)
    files = [f["filename"] for f in first["train"].cache_files]
    assert files and all(Path(f).is_file() for f in files)  # memory-mapped Arrow files, not in memory
    cache_dir = Path(files[0]).parent
    before = {p: p.stat().st_mtime_ns for p in cache_dir.iterdir()}
    again = D.tokenize_and_pack(D.load_raw_text(train_file=str(tmp_path / "docs.jsonl"), val_fraction=0.2),
                                tok, block_size=16, num_proc=2)
    assert [f["filename"] for f in again["train"].cache_files] == files
    assert {p: p.stat().st_mtime_ns for p in cache_dir.iterdir()} == before  # nothing tokenized or written again
    assert _rows(again["train"]) == _rows(first["train"])
    other = D.tokenize_and_pack(raw, tok, block_size=8, num_proc=2)  # other options: another cache entry
    assert [f["filename"] for f in other["train"].cache_files] != files


@pytest.mark.parametrize("name, content, message", [
    ("broken.json", '[{"text": "a"}, {"text": "b"', r"training file '.*broken.json': not valid JSON \(Expecting "
                                                     r"',' delimiter, line 1 column 29\); a .json file is one JSON"),
    ("x.csv", "a,b\n", r"unsupported data file extension '.csv' for .*x.csv: pass a file \(or a folder of files\) "
                       r"ending in .txt, .raw, .text, .txt.gz, .jsonl, .json, .jsonl.gz, .json.gz, .parquet"),
    ("empty_folder", None, r"training file '.*empty_folder' is a folder without data files"),
    ("bad.jsonl.gz", b"not gzip", r"training file '.*bad.jsonl.gz' cannot be read \(Not a gzipped file"),
    ("bad.parquet", b"PAR1 nope", r"training file '.*bad.parquet' is not a readable Parquet file"),
    ("cut.txt", "abc €".encode()[:-1], r"is not UTF-8 text: it ends inside a character"),
])
def test_bad_files_are_one_line_data_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(D.DataError, match=message) as err:
        D.load_raw_text(train_file=str(path))
    assert "\n" not in str(err.value)


def test_file_checks_read_in_chunks_and_report_offsets_and_lines_across_them(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "CHUNK", 7)  # characters and lines cut across reads
    text = "héllo wörld €uro\n" * 3
    good = _write(tmp_path / "good.txt", text)
    D._check_file(str(good), "training file")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(text.encode() + b"ok \xff tail")
    with pytest.raises(D.DataError, match=f"byte 0xff at offset {len(text.encode()) + 3} "):
        D._check_file(str(bad), "training file")
    lines = tmp_path / "d.jsonl"
    lines.write_text('{"text": "été"}\n' * 4 + '{"text": "é"\n')
    with pytest.raises(D.DataError, match="line 5: not valid JSON"):
        D._check_file(str(lines), "training file")
    with pytest.raises(D.DataError, match="is empty"):
        D._check_file(str(_write(tmp_path / "blank.txt", " \n" * 20)), "training file")


def test_streaming_needs_a_validation_split(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    with pytest.raises(D.DataError, match="--streaming needs a validation split.*pass --validation_file"):
        D.load_raw_text(train_file=str(tmp_path / "docs.jsonl"), streaming=True)


def _reference_blocks(rows, block_size, group_rows):
    """Independent packing: each group of `group_rows` token rows concatenated and cut into blocks, tails dropped."""
    blocks = []
    for start in range(0, len(rows), group_rows):
        stream = [t for row in rows[start:start + group_rows] for t in row]
        blocks += [stream[i:i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    return blocks


@pytest.mark.parametrize("num_proc, add_eos", [(1, False), (2, True)])
def test_packing_a_batch_at_a_time_equals_a_naive_packing_of_the_token_stream(tmp_path, monkeypatch, num_proc,
                                                                                add_eos):
    """The packer holds one batch of about PACK_TOKENS tokens and carries what fills no block to the next batch: the
    blocks must be those of packing each PACK_ROWS rows as one stream. Small PACK_TOKENS / PACK_ROWS so that batches,
    carries and group ends (and rows longer than a block, empty rows) all occur."""
    monkeypatch.setattr(D, "PACK_TOKENS", 100)  # about 2 rows a batch
    monkeypatch.setattr(D, "PACK_ROWS", 24)    # batches of a divisor of 24 rows; the carry is dropped every 24 rows
    docs = [("word " * (i * 7 % 23)) + f"doc {i}\n" if i % 11 else "" for i in range(90)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    raw = D.load_raw_text(train_file=str(tmp_path / "d.jsonl"), validation_file=str(tmp_path / "d.jsonl"))
    tok = D.build_tokenizer(None, raw["train"], vocab_size=280)  # a byte-level BPE: it has an EOS token
    assert D._packing_rows(__import__("numpy").full(90, 50)) == 2
    blocks = D.tokenize_and_pack(raw, tok, block_size=16, add_eos=add_eos, num_proc=num_proc)
    eos = [tok.eos_token_id] if add_eos else []
    rows = [tok(d, add_special_tokens=False)["input_ids"] + eos for d in raw["train"]["text"]]
    reference = _reference_blocks(rows, 16, 24)
    assert len(reference) > 20 and _rows(blocks["train"]) == reference
    assert _rows(blocks["validation"]) == reference  # the same file
    monkeypatch.setattr(D, "PACK_ROWS", 100_000)  # a different key: packed anew, now as one stream
    one_stream = D.tokenize_and_pack(raw, tok, block_size=16, add_eos=add_eos, num_proc=num_proc)
    assert _rows(one_stream["train"]) == _reference_blocks(rows, 16, len(rows))

    packer = D._Packer(16)  # batches must come in order: the carry belongs to the rows before
    packer(blocks["train"].with_format("arrow")[:2], [0, 1])
    with pytest.raises(RuntimeError, match="packing batch at row 5, expected row 2"):
        packer(blocks["train"].with_format("arrow")[:2], [5, 6])


def test_streaming_tokenizes_in_batches_of_the_same_size_as_the_map_style_path(tmp_path, monkeypatch):
    """Both paths ask `tokenizing_rows` for about TOKENIZE_CHARS characters a batch (the stream from its head); the
    stream packs each batch as one stream (memory bounded by a batch), the map-style path the whole split."""
    monkeypatch.setattr(D, "TOKENIZE_CHARS", 300)
    docs = [f"document {i:03d} of the same length.\n" for i in range(100)]  # 33 characters each: 9 rows a batch
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = _char_tokenizer()
    calls = []

    class Recording:  # the encoder, counting the texts of every call
        def __init__(self, encoder):
            self.encoder = encoder

        def encode_batch_fast(self, texts, **kwargs):
            calls.append(len(texts))
            return self.encoder.encode_batch_fast(texts, **kwargs)

    raw = D.load_raw_text(train_file=str(tmp_path / "d.jsonl"), validation_file=str(tmp_path / "d.jsonl"),
                          streaming=True)
    assert D.tokenizing_rows(D._n_chars(raw["validation"]) / len(raw["validation"])) == 9
    encoder = D._encoder
    monkeypatch.setattr(D, "_encoder", lambda tokenizer: Recording(encoder(tokenizer)))
    stream = _rows(D.tokenize_and_pack(D.DatasetDict({"train": raw["train"]}), tok, block_size=16)["train"])
    assert calls == [9] * 11 + [1]  # (the validation split is tokenized in a worker process: not seen here)
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    groups = [sum(ids[i:i + 9], []) for i in range(0, len(ids), 9)]  # each batch one stream, its tail dropped
    assert stream == [g[j:j + 16] for g in groups for j in range(0, len(g) // 16 * 16, 16)]
    whole = sum(ids, [])
    assert _rows(D.tokenize_and_pack(raw, tok, block_size=16, num_proc=1)["validation"]) == \
        [whole[j:j + 16] for j in range(0, len(whole) // 16 * 16, 16)]
