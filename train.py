"""Train a bilinear recurrent LM (or a parameter-matched Llama / Mamba / LSTM baseline) with Accelerate.

    accelerate launch train.py --config bilinear_lm/configs/tiny.yaml [--KEY VALUE ...] [--model.KEY VALUE ...]

Single process, N GPUs (`accelerate launch --multi_gpu --num_processes N`), CPU DDP
(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`) and FSDP
(`accelerate launch --config_file bilinear_lm/configs/accelerate/fsdp.yaml`) all run this same file.
`python train.py --help` lists every key; the parts live in `bilinear_lm.training`.

Reads top to bottom: data -> model and optimizer -> the training loop (log, evaluate, checkpoint) -> finish (save,
plot, sample, lm-eval) -> main, which calls them in that order -> the command line.
"""
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.compute as pc
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, send_to_device, set_seed
from datasets import DatasetDict, IterableDataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer, get_cosine_with_min_lr_schedule_with_warmup

from bilinear_lm.baselines import bilinear_config, build_model, count_parameters, optimizer_groups
from bilinear_lm.modeling.transitions import build_kernels
from bilinear_lm.modeling.modeling_bilinear import check_token_ids as check_vocabulary
from bilinear_lm.training import (DEFAULT_TRAIN_FILE, Config, DataError, MetricsLog, TrainingInputError, TrainState,
                                  append_metrics, bf16_cpu_warning, build_tokenizer, check_config_change, check_launch,
                                  find_checkpoint, load_data_state, load_raw_text, params_identical_across_ranks,
                                  parse_config, plot_losses, save_checkpoint, together, tokenize_and_pack,
                                  unsharded_copy)
from bilinear_lm.training.data import builder_for
from bilinear_lm.utils import eval_mode, keep_freed_memory


# -------------------------------------------------------------------------------------------------- data
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
            build_tokenizer(cfg.data.tokenizer, tok_text, cfg.data.bpe_vocab_size).save_pretrained(tok_dir)
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


def check_token_ids(blocks: DatasetDict, vocab_size: int) -> None:
    """Every token id of the packed data must have an embedding: a clear error before training instead of
    torch's `IndexError: index out of range in self` (or a silent wrong lookup on a GPU)."""
    for split, ds in blocks.items():
        if isinstance(ds, IterableDataset):  # streamed: not known before training reads it
            continue
        high = pc.max(pc.list_flatten(ds.data.column("input_ids"))).as_py()  # without materializing the ids
        try:
            check_vocabulary(torch.tensor([0 if high is None else high]), vocab_size, where=f"in the {split} data",
                            fix=f"the tokenizer produces ids its length does not count, or --model.vocab_size is too "
                                f"small: pass --model.vocab_size {high + 1} (or more), or a tokenizer whose ids are "
                                f"below len(tokenizer)")
        except ValueError as error:
            raise TrainingInputError(str(error)) from None


# ------------------------------------------------------------------------------------ model + optimizer
def build_model_and_optimizer(cfg: Config, accelerator, tokenizer):
    """The model (`--model_type`, sized by `--model.*`), AdamW on the model's own parameter groups and the
    warmup + cosine schedule; not yet `accelerator.prepare`d."""
    special = {k: getattr(tokenizer, k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    model_cfg = dict(cfg.model)
    vocab_size = model_cfg.pop("vocab_size", None) or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise TrainingInputError(f"--model.vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} "
                                 f"tokens): omit it (default len(tokenizer)) or pass at least {len(tokenizer)}")
    if cfg.train.model_type == "bilinear":
        model_cfg.update({k: v for k, v in special.items() if v is not None})
    try:  # the baselines are sized from the bilinear config, so it must be valid for every model type
        bilinear_config(model_cfg, vocab_size)
    except (TypeError, ValueError) as err:
        raise TrainingInputError(f"--model.*: {err}") from None
    model = build_model(cfg.train.model_type, model_cfg, vocab_size=vocab_size)
    for k, v in special.items():
        setattr(model.config, k, v)
        setattr(model.generation_config, k, v)
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.train.weight_decay), lr=cfg.train.learning_rate,
                                  betas=(cfg.train.beta1, cfg.train.beta2))
    # the prepared scheduler steps once per process per optimizer step (Accelerate convention)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg.train.warmup_steps * accelerator.num_processes,
        num_training_steps=cfg.train.max_steps * accelerator.num_processes, min_lr_rate=cfg.train.min_lr_ratio,
    )
    return model, optimizer, scheduler


# ------------------------------------------------------------------------------------------------- loop
def evaluate(model, val_dl, accelerator, eval_iters: int) -> dict:
    """Mean validation loss (over ranks and the first `eval_iters` batches, 0 = all) and its perplexity."""
    losses = []
    with torch.no_grad(), eval_mode(model):
        for i, batch in enumerate(val_dl):
            if eval_iters and i >= eval_iters:
                break
            loss = model(**batch).loss
            losses.append(accelerator.gather(loss.detach().float().reshape(1)))  # one batch mean per rank
    val_loss = torch.cat(losses).mean().item()
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


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


def train(cfg: Config, accelerator, model, optimizer, scheduler, data: Data, state: TrainState,
          metrics: MetricsLog) -> None:
    """Optimizer steps until `max_steps`: log every `log_interval`, evaluate every `eval_interval`, checkpoint
    every `save_interval` steps. Updates `state` in place."""
    if state.step >= cfg.train.max_steps:
        return
    tokens_per_step = (cfg.train.batch_size * cfg.train.gradient_accumulation_steps * accelerator.num_processes
                       * cfg.data.block_size)
    pbar = tqdm(total=cfg.train.max_steps, initial=state.step, disable=not accelerator.is_local_main_process,
                desc="train", dynamic_ncols=True)
    model.train()
    logged_step, logged_seconds = state.step, state.train_seconds  # where the throughput of the next log starts
    micro_losses = []  # this optimizer step's micro-batch losses
    t_mark = time.time()
    for batch in micro_batches(accelerator, data.train_dl, state):
        lr = scheduler.get_last_lr()[0]  # the learning rate this step uses
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # the norm of the reduced gradients: the same on every rank
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or math.inf)
                # None: DeepSpeed clips inside its engine; with fp16 a non-finite norm is the loss scaler's to skip
                if grad_norm is not None and accelerator.scaler is None and not math.isfinite(grad_norm):
                    raise TrainingInputError(diverged_message(cfg, state.step + 1,
                                                              f"the gradient norm is {float(grad_norm)}"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        micro_losses.append(loss.detach().float())
        if not accelerator.sync_gradients:
            continue

        state.step += 1
        state.train_seconds += time.time() - t_mark
        pbar.update(1)
        last = state.step == cfg.train.max_steps
        saving = bool(cfg.train.save_interval) and state.step % cfg.train.save_interval == 0
        logging = state.step % cfg.train.log_interval == 0 or last
        if logging or saving:  # the same value on every rank: every rank stops, or none
            train_loss = accelerator.reduce(sum(micro_losses) / len(micro_losses), reduction="mean").item()
            if not math.isfinite(train_loss):  # before a diverged model is logged, evaluated or saved
                raise TrainingInputError(diverged_message(cfg, state.step, f"the training loss is {train_loss}"))
        if logging:
            tokens_per_sec = (tokens_per_step * (state.step - logged_step)
                              / max(state.train_seconds - logged_seconds, 1e-9))
            metrics.log({"step": state.step, "loss": train_loss, "lr": lr, "train_seconds": state.train_seconds,
                         "tokens_per_sec": tokens_per_sec, "epoch": state.epoch})
            pbar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_sec:.0f}")
            logged_step, logged_seconds = state.step, state.train_seconds
        micro_losses = []

        if cfg.train.eval_interval and (state.step % cfg.train.eval_interval == 0 or last):
            record = {"step": state.step, "train_seconds": state.train_seconds,
                      **evaluate(model, data.val_dl, accelerator, cfg.train.eval_iters)}
            metrics.log(record)
            if accelerator.is_local_main_process:
                pbar.write(f"step {state.step}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.2f}")
        if saving:
            save_checkpoint(accelerator, cfg.train.output_dir, state, data.tokenizer, cfg,
                            total_limit=cfg.train.save_total_limit,
                            data_state=data.stream.state_dict() if data.stream is not None else None)
        t_mark = time.time()  # evaluation and checkpoint time is not training time
        if last:
            break
    pbar.close()


def diverged_message(cfg: Config, step: int, what: str) -> str:
    """The error of a run whose gradient or training loss (``what``) stopped being finite, before the weights take
    it: where, what is kept, and what to do."""
    kept = find_checkpoint(cfg.train.output_dir, "latest", warn=lambda _: None)
    resumed = cfg.train.resume_from_checkpoint
    if kept is not None:
        resume = (f"the last checkpoint, {kept}, is from before it: resume from it with --resume_from_checkpoint "
                  "latest --allow_config_change and a lower --learning_rate")
    elif resumed not in (None, "latest"):  # resumed from a checkpoint of another run's folder
        resume = (f"no checkpoint was saved since this run resumed from {resumed}: resume from it again with "
                  "--allow_config_change and a lower --learning_rate")
    else:
        resume = "no checkpoint was saved: start again with a lower --learning_rate"
    return (f"{what} at step {step} (learning rate {cfg.train.learning_rate:g}): the run diverged and stops here; "
            f"{resume} (or a smaller --grad_clip)")


# ----------------------------------------------------------------------------------------------- finish
def print_sample(cfg: Config, model, tokenizer, raw: DatasetDict, device) -> None:
    """`sample_tokens` sampled tokens (top-k 50) after `sample_prompt`, else the start of the validation text."""
    prompt = cfg.train.sample_prompt or raw["validation"][0]["text"][:32] or "\n"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    model.eval()
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=cfg.train.sample_tokens, do_sample=True, top_k=50,
                             pad_token_id=tokenizer.pad_token_id)
    print(f"--- sample ({cfg.train.sample_tokens} tokens after the prompt {prompt!r}) ---")
    print(tokenizer.decode(gen[0], skip_special_tokens=True))
    print("---")


def run_harness(cfg: Config, model, tokenizer, out_dir: Path) -> None:
    """lm-eval-harness on the final model (`--eval_lm_harness` tasks), written to OUTPUT_DIR/lm_harness.json."""
    from bilinear_lm.evaluation.harness import run_lm_eval  # imported here: lm-eval is needed only with --eval_lm_harness

    tasks = [t.strip() for t in cfg.train.eval_lm_harness.split(",") if t.strip()]
    results = run_lm_eval(model, tokenizer, tasks, limit=cfg.train.lm_harness_limit)  # {task: {metric: value}}
    (out_dir / "lm_harness.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"lm-eval-harness results written to {out_dir / 'lm_harness.json'}")


def finish(cfg: Config, accelerator, model, data: Data, state: TrainState, metrics: MetricsLog, n_params: int) -> dict:
    """save_pretrained (model, tokenizer, generation config), the final metrics record, loss.png, a sample and
    lm-eval; returns the final record."""
    unwrapped = accelerator.unwrap_model(model)
    final = {"step": state.step, "final": True,
             "params_identical_across_ranks": params_identical_across_ranks(accelerator, unwrapped),
             "num_processes": accelerator.num_processes, "n_params": n_params}
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    out_dir = Path(cfg.train.output_dir)
    if accelerator.is_main_process:
        # a shallow copy: save_pretrained empties the dict it is given (transformers 5); the unsharded copy needs it
        unwrapped.save_pretrained(out_dir, state_dict=dict(state_dict), safe_serialization=True)
        data.tokenizer.save_pretrained(out_dir)
        unwrapped.generation_config.save_pretrained(out_dir)
        append_metrics(metrics.path, final)
        plot_losses(metrics.path, out_dir / "loss.png")
        # a sharded forward needs every rank: the main process alone samples and evaluates an unsharded copy
        if accelerator.distributed_type == DistributedType.FSDP and (cfg.train.sample_tokens
                                                                       or cfg.train.eval_lm_harness):
            unwrapped = unsharded_copy(unwrapped, state_dict).to(accelerator.device)
        if cfg.train.sample_tokens:
            print_sample(cfg, unwrapped, data.tokenizer, data.raw, accelerator.device)
        if cfg.train.eval_lm_harness:
            run_harness(cfg, unwrapped, data.tokenizer, out_dir)
        print(f"saved model, tokenizer and generation config to {out_dir}")
    return final


def end_training(accelerator) -> None:
    """Free the prepared model, then destroy the process group. Order matters under DDP over gloo: the model's
    Reducer holds the group, and if it is freed last the group's destructor joins gloo's worker thread while holding
    the GIL, which that thread may need to drop a finished collective's tensors: a deadlock at exit, 1 launch in 5
    (pytorch/pytorch#56297; docs/results-history.md). Freed first, the group's last reference is the Python one,
    whose destructor releases the GIL."""
    accelerator.free_memory()  # drops the accelerator's references to the model, optimizer, scheduler, loaders
    gc.collect()  # free_memory collects before it drops them; a DDP model is in reference cycles
    accelerator.end_training()


# ------------------------------------------------------------------------------------------------- main
def flat_config(cfg: Config) -> dict:
    """The config as tracker hyperparameters: scalars as they are, `model.KEY` for the model keys."""
    flat = {**asdict(cfg.data), **asdict(cfg.train), **{f"model.{k}": v for k, v in cfg.model.items()}}
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


def main(argv: list[str] | None = None) -> dict:
    """Train as configured by ``argv`` (the command line's arguments); returns the final metrics record.
    Bad input raises TrainingInputError or DataError."""
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    out_dir = Path(cfg.train.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        mixed_precision=cfg.train.mixed_precision,  # None: the launcher's (ACCELERATE_MIXED_PRECISION), else no
        log_with=None if cfg.train.report_to == "none" else cfg.train.report_to,
        project_dir=str(out_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
    )
    check_launch(accelerator)  # N launched processes that each run alone would race on out_dir
    warning = bf16_cpu_warning(accelerator.mixed_precision, accelerator.device.type)
    if warning:
        accelerator.print(warning)
    set_seed(cfg.train.seed)
    resume_spec = cfg.train.resume_from_checkpoint
    # damaged checkpoints are skipped by `latest` (with a warning), an error when named; then the options must match
    resume = find_checkpoint(cfg.train.output_dir, resume_spec, warn=accelerator.print) if resume_spec else None
    if resume_spec == "latest" and resume is None:
        accelerator.print(f"no complete checkpoint in {out_dir}/checkpoints: starting from scratch")
    if resume is not None:
        check_config_change(resume, cfg, warn=accelerator.print)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)

    data = load_data(cfg, accelerator, resume)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, accelerator, data.tokenizer)
    check_token_ids(data.blocks, model.config.vocab_size)
    if cfg.train.model_type == "bilinear":  # compile the CPU scan now: its build stays out of the first tokens/s
        build_kernels(model.config, accelerator.device.type)
    n_params = count_parameters(model)
    batch, n_proc, accum = cfg.train.batch_size, accelerator.num_processes, cfg.train.gradient_accumulation_steps
    n_train = "streamed" if data.stream is not None else len(data.blocks["train"])
    accelerator.print(
        f"{cfg.train.model_type} model: {n_params / 1e6:.3f}M parameters, vocab {model.config.vocab_size}, "
        f"{n_train} train / {len(data.blocks['validation'])} val blocks of {cfg.data.block_size}\n"
        f"{n_proc} process{'es' if n_proc > 1 else ''} ({accelerator.distributed_type.value}), global batch "
        f"{batch * n_proc * accum} sequences = batch_size {batch} x {n_proc} processes x {accum} accumulation steps "
        f"({batch * n_proc * accum * cfg.data.block_size} tokens per optimizer step), mixed precision "
        f"{accelerator.mixed_precision}")
    if data.stream is None:
        model, optimizer, data.train_dl, data.val_dl, scheduler = accelerator.prepare(
            model, optimizer, data.train_dl, data.val_dl, scheduler)
    else:  # see micro_batches
        model, optimizer, data.val_dl, scheduler = accelerator.prepare(model, optimizer, data.val_dl, scheduler)

    state = TrainState()
    if resume is not None:
        accelerator.load_state(str(resume))
        state = TrainState.load(resume)
        if data.stream is not None:
            data.stream.load_state_dict(load_data_state(resume, accelerator.process_index))
        accelerator.print(f"resumed from {resume} at step {state.step} (epoch {state.epoch}, batch "
                          f"{state.batches_done}, {state.train_seconds:.1f} s of training)")
    metrics = MetricsLog(accelerator, out_dir / "metrics.jsonl")
    metrics.start(resumed_at=state.step if resume is not None else None)
    if accelerator.log_with:
        accelerator.init_trackers("bilinear_lm", config=flat_config(cfg))

    train(cfg, accelerator, model, optimizer, scheduler, data, state, metrics)
    final = finish(cfg, accelerator, model, data, state, metrics, n_params)
    del model, optimizer, scheduler, data
    end_training(accelerator)
    return final


def cli(argv: list[str] | None = None) -> int:
    """The command line: bad input is one line on stderr and exit status 1 (anything else is a bug and keeps its
    traceback); `--help` prints every key and exits."""
    keep_freed_memory()  # large activations reused, not faulted in again each step (docs/training.md)
    try:
        main(argv)
    except (TrainingInputError, DataError) as err:
        sys.stderr.write(f"error: {err}\n")  # one write: the lines of a launch's processes never interleave
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
