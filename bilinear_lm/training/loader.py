"""train.py's data: the text -> tokenizer -> packed blocks of `data.py`, built once for every rank, and their loaders
(`load_data`, returning `Data`), the check that every token id has an embedding, and the micro-batches the training
loop reads, epoch after epoch (`micro_batches`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import torch
from accelerate.utils import send_to_device
from datasets import DatasetDict, IterableDataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from ..modeling.input_checks import check_token_ids
from .checkpoint import TrainState
from .config import Config, TrainingInputError
from .data import DEFAULT_TRAIN_FILE, build_tokenizer, builder_for, load_raw_text, tokenize_and_pack
from .distributed import together


@dataclass
class Data:
    """The text, its tokenizer, the packed blocks and their loaders (not yet `accelerator.prepare`d)."""

    raw: DatasetDict     # text: train, validation
    tokenizer: object    # PreTrainedTokenizerFast, saved next to every checkpoint and the final model
    blocks: DatasetDict  # packed blocks (input_ids): cached on disk; the train split an IterableDataset with --streaming
    train_dl: DataLoader
    val_dl: DataLoader
    stream: IterableDataset | None = None  # --streaming: this rank's training blocks; checkpoints save its position


def collate(rows: list[dict]) -> dict:
    """A batch of packed blocks; the labels are the input ids (the model shifts them)."""
    ids = torch.stack([row["input_ids"] for row in rows]).long()
    return {"input_ids": ids, "labels": ids}


def load_data(cfg: Config, accelerator, resume: Path | None) -> Data:
    """Text (`--train_file`, else `--dataset`, else the Tiny Shakespeare text shipped with the package) -> tokenizer
    (built once by the main process; every rank loads the same files) -> packed blocks (tokenized by the main process
    into the `datasets` cache, which the other ranks then load; with --streaming, as training reads them, each rank
    its share) and their loaders."""
    train_file = cfg.data.train_file or (None if cfg.data.dataset else DEFAULT_TRAIN_FILE)
    raw = load_raw_text(dataset=None if train_file else cfg.data.dataset, dataset_config=cfg.data.dataset_config,
                        train_file=train_file, validation_file=cfg.data.validation_file,
                        text_column=cfg.data.text_column, val_fraction=cfg.data.val_fraction,
                        streaming=cfg.data.streaming)
    tok_dir = (resume / "tokenizer") if resume else (Path(cfg.train.output_dir) / "tokenizer")

    def tokenizer_files():
        if resume is None and accelerator.is_main_process:
            # a char vocabulary covers every split (like nanoGPT); a BPE is trained on the training text only
            tok_text = list(raw.values()) if cfg.data.tokenizer == "char" else raw["train"]
            if cfg.data.tokenizer == "bpe":
                print(f"training a byte-level BPE of {cfg.data.bpe_vocab_size} tokens on the training text", flush=True)
            # the trainer's progress bars on a terminal (elsewhere they are blank lines)
            build_tokenizer(cfg.data.tokenizer, tok_text, cfg.data.bpe_vocab_size,
                            show_progress=sys.stderr.isatty()).save_pretrained(tok_dir)
        return AutoTokenizer.from_pretrained(tok_dir)

    tokenizer = together(accelerator, tokenizer_files, "building the tokenizer", main_first=True)
    add_eos = cfg.data.add_eos
    if add_eos is None:  # rows are documents in JSON / Parquet files and Hub datasets, lines (with their "\n") in .txt
        add_eos = train_file is None or builder_for(train_file) != "text"
    if add_eos and tokenizer.eos_token_id is None:
        raise TrainingInputError("EOS after every row (--add_eos true, the default for .jsonl files and Hub datasets) "
                                 "needs a tokenizer with an EOS token (the char tokenizer has none): pass --add_eos "
                                 "false or another --tokenizer")
    if cfg.train.eval_lm_harness and tokenizer.eos_token_id is None:
        raise TrainingInputError("--eval_lm_harness needs a tokenizer with an EOS token (lm-eval uses it as the "
                                 "end-of-text token; the char tokenizer has none): omit --tokenizer char")
    blocks = together(accelerator, lambda: tokenize_and_pack(raw, tokenizer, cfg.data.block_size, add_eos=add_eos,
                                                             num_proc=cfg.data.num_proc),
                      "tokenizing the data", main_first=True)
    blocks = DatasetDict({split: ds.with_format("torch") for split, ds in blocks.items()})
    batch_size, workers = cfg.train.batch_size, cfg.data.num_workers
    val_dl = DataLoader(blocks["validation"], batch_size=batch_size, shuffle=False, num_workers=workers,
                        collate_fn=collate)
    if cfg.data.streaming:  # in order; every rank reads its share of the blocks
        stream = split_dataset_by_node(blocks["train"], rank=accelerator.process_index,
                                       world_size=accelerator.num_processes)
        return Data(raw, tokenizer, blocks, DataLoader(stream, batch_size=batch_size, drop_last=True,
                                                       collate_fn=collate), val_dl, stream)
    train_dl = DataLoader(blocks["train"], batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                          collate_fn=collate)
    if len(train_dl) == 0:
        raise TrainingInputError(
            f"only {len(blocks['train'])} training blocks of {cfg.data.block_size} tokens: fewer than --batch_size "
            f"{batch_size}; lower batch_size/block_size or add data")
    return Data(raw, tokenizer, blocks, train_dl, val_dl)


def check_blocks_fit_vocabulary(blocks: DatasetDict, vocab_size: int) -> None:
    """Every token id of the packed data must have an embedding: a clear error before training instead of
    torch's `IndexError: index out of range in self` (or a silent wrong lookup on a GPU)."""
    for split, ds in blocks.items():
        if isinstance(ds, IterableDataset):  # streamed: not known before training reads it
            continue
        high = pc.max(pc.list_flatten(ds.data.column("input_ids"))).as_py()  # without materializing the ids
        try:
            check_token_ids(torch.tensor([0 if high is None else high]), vocab_size, where=f"in the {split} data",
                             fix=f"the tokenizer produces ids its length does not count, or --model.vocab_size is too "
                                 f"small: pass --model.vocab_size {high + 1} (or more), or a tokenizer whose ids are "
                                 f"below len(tokenizer)")
        except ValueError as error:
            raise TrainingInputError(str(error)) from None


def micro_batches(accelerator, train_dl, state: TrainState):
    """Training micro-batches, epoch after epoch, from where `state` stands (the seedable sampler's order for the
    epoch, minus what the epoch already consumed: a resumed run sees the batches an uninterrupted one would). A
    stream (--streaming) continues from its own restored position; its loader is not `prepare`d (Accelerate's reads
    a batch ahead, which the saved position would count), so its batches are moved to the device here. A pass that
    gives this process no batch is an error: the loop would spin here forever (and the other ranks wait for it in
    their first collective)."""
    empty_passes = 0  # in a row; a resumed stream may start at its end, so a pass from its start must be empty too
    while True:
        if isinstance(train_dl.dataset, IterableDataset):
            train_dl.dataset.set_epoch(state.epoch)
            loader = (send_to_device(batch, accelerator.device) for batch in train_dl)
        else:
            train_dl.set_epoch(state.epoch)
            loader = accelerator.skip_first_batches(train_dl, state.batches_done) if state.batches_done else train_dl
        batches = 0
        for batch in loader:
            state.batches_done, batches = state.batches_done + 1, batches + 1
            yield batch
        empty_passes = 0 if batches else empty_passes + 1
        if empty_passes == 2:
            n, rows = accelerator.num_processes, train_dl.batch_size
            share = f"{n} processes share" if n > 1 else "1 process reads"
            raise TrainingInputError(
                f"the training data gives process {accelerator.process_index} no batch of --batch_size {rows} blocks "
                f"in a whole pass over the data ({share} its blocks, so it needs at least {n * rows} blocks of "
                f"--block_size tokens); add data or lower --batch_size or --block_size")
        state.epoch, state.batches_done = state.epoch + 1, 0
