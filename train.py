"""Train a bilinear recurrent LM (or a parameter-matched Llama / Mamba / LSTM baseline) with Accelerate.

    accelerate launch train.py --config bilinear_lm/configs/tiny.yaml [--KEY VALUE ...] [--model.KEY VALUE ...]

Single process, N GPUs (`accelerate launch --multi_gpu --num_processes N`), CPU DDP
(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`) and FSDP
(`accelerate launch --config_file bilinear_lm/configs/accelerate/fsdp.yaml`) all run this same file.
`python train.py --help` lists every key; the parts live in `bilinear_lm.training`.

Reads top to bottom: model and optimizer -> the training loop (log, evaluate, checkpoint) -> finish (save, plot,
sample, lm-eval) -> main: the config, the output folder this run owns (`bilinear_lm.training.output_dir`) and the
signals that stop it (`bilinear_lm.training.stopping`), then run: the data (`bilinear_lm.training.loader`), then the
parts above in that order -> the command line.
"""
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # the help, without loading the training stack
    from bilinear_lm.training.config import ConfigParser

    sys.exit(ConfigParser().print_help())

import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from datasets import DatasetDict
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from bilinear_lm.baselines import bilinear_config, build_model, count_parameters, optimizer_groups
from bilinear_lm.evaluation.harness import run_harness
from bilinear_lm.modeling.transitions import build_kernels
from bilinear_lm.training import (Config, Data, DataError, DiskFullError, MetricsLog, StopOnSignal, Stopped,
                                  TrainingInputError, TrainState, append_metrics, bf16_cpu_warning,
                                  check_blocks_fit_vocabulary, check_launch, disk_full_is_one_line, diverged_message,
                                  end_training, flat_config, load_data, load_data_state, micro_batches, own_output_dir,
                                  params_identical_across_ranks, parse_config, peak_rss_mib, plot_losses, read_metrics,
                                  run_summary, save_checkpoint, unsharded_copy, write_model_card)
from bilinear_lm.utils import eval_mode, keep_freed_memory


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
        model = build_model(cfg.train.model_type, model_cfg, vocab_size=vocab_size)
    except (TypeError, ValueError) as err:
        raise TrainingInputError(f"--model.*: {err}") from None
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
    """Mean validation loss (over ranks and the first `eval_iters` batches, 0 = all) and its perplexity.

    The batch means are summed as Python floats: a small tensor kept per batch lands between the large blocks the
    next batch frees, and glibc's heap then grows by about a batch's logits a batch (8.9 GB after 100 Gutenberg
    batches, docs/results-history.md, 2026-12-01)."""
    loss_sum, count = 0.0, 0
    total = min(eval_iters, len(val_dl)) if eval_iters else len(val_dl)
    with torch.no_grad(), eval_mode(model), tqdm(total=total, desc="eval", leave=False, dynamic_ncols=True, delay=2,
                                                 disable=not accelerator.is_local_main_process) as pbar:
        for i, batch in enumerate(val_dl):
            if eval_iters and i >= eval_iters:
                break
            pbar.update(1)  # shown when an evaluation takes more than 2 s
            loss = model(**batch).loss
            batch_means = accelerator.gather(loss.detach().float().reshape(1))  # one batch mean per rank
            loss_sum, count = loss_sum + batch_means.double().sum().item(), count + batch_means.numel()
    val_loss = loss_sum / count
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


def train(cfg: Config, accelerator, model, optimizer, scheduler, data: Data, state: TrainState,
          metrics: MetricsLog, stop: StopOnSignal) -> Stopped | None:
    """Optimizer steps until `max_steps`: log every `log_interval`, evaluate every `eval_interval`, checkpoint
    every `save_interval` steps. Updates `state` in place. A SIGTERM / SIGINT stops it at the end of a step, after
    a checkpoint (every rank at the same step): it returns the Stopped to raise."""
    if state.step >= cfg.train.max_steps:
        return None
    tokens_per_step = (cfg.train.batch_size * cfg.train.gradient_accumulation_steps * accelerator.num_processes
                       * cfg.data.block_size)
    pbar = tqdm(total=cfg.train.max_steps, initial=state.step, disable=not accelerator.is_local_main_process,
                desc="train", dynamic_ncols=True)
    model.train()
    logged_step, logged_seconds = state.step, state.train_seconds  # where the throughput of the next log starts
    micro_losses = []  # this optimizer step's micro-batch losses
    t_mark = time.time()
    stop.defer()  # a signal now waits for the end of the step
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
                      **evaluate(model, data.val_dl, accelerator, cfg.train.eval_iters), "peak_rss_mib": peak_rss_mib()}
            metrics.log(record)
            if accelerator.is_local_main_process:
                pbar.write(f"step {state.step}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.2f}")
        stop_signal = stop.requested(accelerator)  # SIGTERM / SIGINT on any rank: every rank stops after this step
        if saving or stop_signal:
            checkpoint = save_checkpoint(accelerator, cfg.train.output_dir, state, data.tokenizer, cfg,
                                         total_limit=cfg.train.save_total_limit,
                                         data_state=data.stream.state_dict() if data.stream is not None else None)
        if stop_signal:
            pbar.close()
            return stop.stopped(accelerator, stop_signal, state.step, checkpoint)
        t_mark = time.time()  # evaluation and checkpoint time is not training time
        if last:
            break
    pbar.close()
    stop.undefer()
    return None


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


def finish(cfg: Config, accelerator, model, data: Data, state: TrainState, metrics: MetricsLog, n_params: int) -> dict:
    """save_pretrained (model, tokenizer, generation config), the final metrics record, loss.png, a sample and
    lm-eval; returns the final record."""
    unwrapped = accelerator.unwrap_model(model)
    final = {"step": state.step, "final": True,
             "params_identical_across_ranks": params_identical_across_ranks(accelerator, unwrapped),
             "num_processes": accelerator.num_processes, "n_params": n_params, "peak_rss_mib": peak_rss_mib()}
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    out_dir = Path(cfg.train.output_dir)
    if accelerator.is_main_process:
        with disk_full_is_one_line(cfg.train.output_dir, "the final model"):
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
            run_harness(unwrapped, data.tokenizer, cfg.train.eval_lm_harness, cfg.train.lm_harness_limit, out_dir)
        write_model_card(out_dir, cfg, unwrapped, n_params, read_metrics(metrics.path))
        print(f"saved model, tokenizer, generation config and model card (README.md) to {out_dir}")
    return final


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """Train as configured by ``argv`` (the command line's arguments); returns the final metrics record.
    Bad input raises TrainingInputError or DataError."""
    started = time.time()
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    out_dir = Path(cfg.train.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        mixed_precision=cfg.train.mixed_precision,  # train.py's, else the launcher's, else the preset's (parse_config)
        log_with=None if cfg.train.report_to == "none" else cfg.train.report_to,
        project_dir=str(out_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
    )
    check_launch(accelerator)  # N launched processes that each run alone would race on out_dir
    warning = bf16_cpu_warning(accelerator.mixed_precision, accelerator.device.type)
    if warning:
        accelerator.print(warning)
    set_seed(cfg.train.seed)
    # from here SIGTERM / SIGINT stop the run with one line (at a step's end: after a checkpoint); the run owns
    # out_dir (a lock; another run's results refused), `resume` is the checkpoint it continues (docs/training.md)
    with StopOnSignal() as stop, own_output_dir(accelerator, cfg, warn=accelerator.print) as resume:
        return run(cfg, accelerator, resume, stop, started)


def run(cfg: Config, accelerator, resume, stop: StopOnSignal, started: float) -> dict:
    """main's run in its output folder: the data, the model, training, the finish (a stopped run ends after its
    checkpoint: Stopped); ``started``: when main began (the closing summary's wall-clock)."""
    out_dir = Path(cfg.train.output_dir)
    data = load_data(cfg, accelerator, resume)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, accelerator, data.tokenizer)
    check_blocks_fit_vocabulary(data.blocks, model.config.vocab_size)
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
        f"{accelerator.mixed_precision} ({cfg.mixed_precision_from})")
    if data.stream is None:
        model, optimizer, data.train_dl, data.val_dl, scheduler = accelerator.prepare(
            model, optimizer, data.train_dl, data.val_dl, scheduler)
    else:  # see micro_batches (bilinear_lm.training.loader)
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

    stopped = train(cfg, accelerator, model, optimizer, scheduler, data, state, metrics, stop)
    final = None if stopped else finish(cfg, accelerator, model, data, state, metrics, n_params)
    if final is not None and accelerator.is_main_process:
        tokens = state.step * batch * n_proc * accum * cfg.data.block_size
        print(run_summary(read_metrics(metrics.path), state.step, state.train_seconds, time.time() - started, tokens,
                          out_dir, torch.cuda.max_memory_allocated() if accelerator.device.type == "cuda" else None))
    del model, optimizer, scheduler, data
    end_training(accelerator)
    if stopped:
        raise stopped
    return final


def cli(argv: list[str] | None = None) -> int:
    """The command line: bad input (and a full disk) is one line on stderr and exit status 1 (anything else is a bug and keeps its
    traceback); a SIGTERM / SIGINT one line and 128 + the signal's number; `--help` prints every key and exits."""
    keep_freed_memory()  # large activations reused, not faulted in again each step (docs/training.md)
    try:
        main(argv)
    except (TrainingInputError, DataError, DiskFullError) as err:
        sys.stderr.write(f"error: {err}\n")  # one write: the lines of a launch's processes never interleave
        return 1
    except Stopped as stopped:
        if not stopped.printed:
            sys.stderr.write(f"{stopped}\n")
        return stopped.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(cli())
