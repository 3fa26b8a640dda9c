"""Train a bilinear recurrent LM (or a parameter-matched Llama / Mamba baseline) with Accelerate.

    accelerate launch train.py --config bilinear_lm/configs/tiny.yaml [--key value ...] [--model.key value ...]

Single process, N GPUs (`accelerate launch --multi_gpu --num_processes N`), CPU DDP
(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`) and FSDP
(`accelerate launch --config_file bilinear_lm/configs/accelerate/fsdp.yaml`) all run this same file.

Reads top to bottom: config -> data -> model and optimizer -> the training loop (log, evaluate, checkpoint) -> finish
(save, plot, sample, lm-eval) -> main, which calls them in that order -> the command line. Checkpoints and the
TrainState they carry, metrics and the helpers for several processes are in `bilinear_lm.training`.
"""
from __future__ import annotations

import json
import math
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from bilinear_lm.training import (MetricsLog, TrainingInputError, TrainState, append_metrics, bf16_cpu_warning,
                                  find_checkpoint, params_identical_across_ranks, plot_losses, save_checkpoint,
                                  together)


# ------------------------------------------------------------------------------------------------ config
# Every training key, its default and its type. A preset (YAML) overrides these; the command line overrides
# the preset. `model:` holds BilinearConfig fields (vocab_size defaults to len(tokenizer)).
DEFAULTS: dict[str, tuple[object, type]] = {
    # data
    "dataset": ("wikitext", str),           # hub dataset name; ignored when train_file is set ("none" = no hub)
    "dataset_config": ("wikitext-2-raw-v1", str),
    "train_file": (None, str),              # local .txt / .jsonl
    "validation_file": (None, str),
    "text_column": ("text", str),
    "val_fraction": (0.1, float),           # held-out tail when there is no validation split
    "add_eos": (None, bool),                # append EOS after every row; default: True for .jsonl files only
    "tokenizer": (None, str),               # None -> train byte-level BPE; "char"; or hub name / local dir
    "bpe_vocab_size": (8192, int),
    "block_size": (256, int),
    # optimization
    "model_type": ("bilinear", str),        # bilinear | llama | mamba | lstm
    "batch_size": (16, int),                # per process, per micro-step
    "gradient_accumulation_steps": (1, int),
    "max_steps": (1000, int),
    "learning_rate": (1e-3, float),
    "min_lr_ratio": (0.1, float),           # cosine decays to learning_rate * min_lr_ratio
    "warmup_steps": (100, int),
    "weight_decay": (0.1, float),           # on matrices only (the model's optimizer_groups): not norms, biases, h0
    "transition_lr_scale": (1.0, float),    # bilinear only: lr multiplier of W1, W2 (W) and factor_bias
    "beta1": (0.9, float),
    "beta2": (0.95, float),
    "grad_clip": (1.0, float),              # 0 disables
    "mixed_precision": ("no", str),         # no | bf16 | fp16
    "seed": (1337, int),
    # logging / evaluation / checkpoints
    "output_dir": ("out", str),
    "log_interval": (10, int),
    "eval_interval": (200, int),
    "eval_iters": (50, int),                # validation batches per evaluation (0 = the whole split)
    "save_interval": (500, int),            # 0 = only the final save_pretrained
    "resume_from_checkpoint": (None, str),  # latest | PATH
    "report_to": ("none", str),             # none | tensorboard | wandb | ... (Accelerate trackers)
    "sample_tokens": (200, int),            # generated at the end (0 = skip)
    "sample_prompt": (None, str),           # default: the start of the validation text
    "eval_lm_harness": (None, str),         # comma-separated lm-eval tasks run on the final model
    "lm_harness_limit": (None, int),
    "num_workers": (0, int),
    "log_shard_checksums": (False, bool),   # record per-rank batch checksums (DDP sanity check)
}
MODEL_KEY = "model"


def _coerce(key: str, value, typ):
    """Turn a CLI string (or YAML value) into `typ`; None/'none'/'null' is allowed for every key."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        return None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise TrainingInputError(f"--{key}: expected true/false, got {value!r}")
    if typ is object:  # model key without a simple type (e.g. eos_token_id: int or list): parse like YAML
        return yaml.safe_load(value) if isinstance(value, str) else value
    try:
        if isinstance(value, bool) and typ is not str:
            raise ValueError
        if typ is int and (isinstance(value, float) or (isinstance(value, str) and any(c in value for c in ".eE"))):
            as_float = float(value)
            if as_float != int(as_float):
                raise ValueError
            return int(as_float)
        return typ(value)
    except (TypeError, ValueError):
        raise TrainingInputError(f"--{key}: expected {typ.__name__}, got {value!r}") from None


def _simple_type(annotation) -> type:
    """bool / int / float / str for an annotation such as `int` or `int | None`; `object` for anything else."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else object
    return annotation if annotation in (bool, int, float, str) else object


def _model_key_types() -> dict[str, type]:
    """Valid `model.*` keys and their types: the fields BilinearConfig declares (`vocab_size` is optional: by default
    the tokenizer's length)."""
    from bilinear_lm import BilinearConfig

    return {name: _simple_type(annotation) for name, annotation in BilinearConfig.__annotations__.items()
            if not name.startswith("_") and typing.get_origin(annotation) is not typing.ClassVar}


def help_text() -> str:
    from bilinear_lm import BilinearConfig

    lines = [__doc__, "training keys (default):"]
    lines += [f"  --{k:<28} {t.__name__:<6} {d!r}" for k, (d, t) in DEFAULTS.items()]
    lines.append("model keys (BilinearConfig fields; the baselines take their depth and size from them):")
    for k, t in _model_key_types().items():
        default = "len(tokenizer)" if k == "vocab_size" else repr(getattr(BilinearConfig, k, None))
        lines.append(f"  --{MODEL_KEY + '.' + k:<28} {'value' if t is object else t.__name__:<6} {default}")
    return "\n".join(lines)


def parse_config(argv: list[str]) -> dict:
    """DEFAULTS <- YAML preset (--config) <- `--key value` / `--model.key value` overrides (raises
    TrainingInputError for an unknown key or a value of the wrong type)."""
    args = list(argv)
    preset: dict = {}
    if "--config" in args or any(a.startswith("--config=") for a in args):
        i = next(i for i, a in enumerate(args) if a == "--config" or a.startswith("--config="))
        path = args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else None)
        del args[i : i + (1 if "=" in args[i] else 2)]
        if not path or not Path(path).is_file():
            raise TrainingInputError(f"--config {path!r}: preset file not found (presets live in bilinear_lm/configs/)")
        preset = yaml.safe_load(Path(path).read_text()) or {}
    unknown = [k for k in preset if k not in DEFAULTS and k != MODEL_KEY]
    if unknown:
        raise TrainingInputError(f"unknown key(s) {unknown} in the preset; valid keys: {sorted(DEFAULTS)} and model.*")

    cfg = {k: _coerce(k, preset.get(k, d), t) for k, (d, t) in DEFAULTS.items()}
    model_types = _model_key_types()
    preset_model = dict(preset.get(MODEL_KEY) or {})
    bad_model = [k for k in preset_model if k not in model_types]
    if bad_model:
        raise TrainingInputError(f"unknown model key(s) {bad_model} in the preset; valid model keys: "
                                 f"{sorted(model_types)}")
    model_cfg = {k: _coerce(f"{MODEL_KEY}.{k}", v, model_types[k]) for k, v in preset_model.items()}

    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise TrainingInputError(f"unexpected argument {arg!r}: overrides look like --key value or "
                                     f"--model.key value")
        key, value = (arg[2:].split("=", 1) + [None])[:2]
        if value is None:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # bare flag
        i += 1
        if key.startswith(MODEL_KEY + "."):
            name = key[len(MODEL_KEY) + 1 :]
            if name not in model_types:
                raise TrainingInputError(f"unknown model key {name!r}; valid model keys: {sorted(model_types)}")
            model_cfg[name] = _coerce(key, value, model_types[name])
        elif key in DEFAULTS:
            cfg[key] = _coerce(key, value, DEFAULTS[key][1])
        else:
            raise TrainingInputError(
                f"unknown config key {key!r}; valid keys: {sorted(DEFAULTS)} (and --model.<key> for "
                f"{sorted(model_types)})"
            )
    cfg[MODEL_KEY] = model_cfg
    if cfg["block_size"] is None or cfg["block_size"] < 1:
        raise TrainingInputError(f"--block_size must be a positive integer, got {cfg['block_size']}")
    from bilinear_lm.baselines import MODEL_TYPES

    if cfg["model_type"] not in MODEL_TYPES:
        raise TrainingInputError(f"--model_type must be one of {MODEL_TYPES}, got {cfg['model_type']!r}")
    if not cfg["transition_lr_scale"] > 0 or (cfg["transition_lr_scale"] != 1 and cfg["model_type"] != "bilinear"):
        raise TrainingInputError(f"--transition_lr_scale must be > 0 and applies to --model_type bilinear only; got "
                                 f"{cfg['transition_lr_scale']} with --model_type {cfg['model_type']}")
    return cfg


# -------------------------------------------------------------------------------------------------- data
@dataclass
class Data:
    raw: object        # DatasetDict of text: train, validation
    tokenizer: object  # PreTrainedTokenizerFast, saved next to every checkpoint and the final model
    blocks: object     # DatasetDict of packed blocks: input_ids, labels
    train_dl: object
    val_dl: object


def load_data(cfg: dict, accelerator, resume: Path | None) -> Data:
    """Text -> tokenizer (built once by the main process; every rank loads the same files) -> packed blocks."""
    from datasets import concatenate_datasets
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from bilinear_lm.training.data import build_tokenizer, load_raw_text, tokenize_and_pack

    raw = load_raw_text(
        dataset=None if cfg["train_file"] or cfg["dataset"] in (None, "none") else cfg["dataset"],
        dataset_config=cfg["dataset_config"], train_file=cfg["train_file"],
        validation_file=cfg["validation_file"], text_column=cfg["text_column"], val_fraction=cfg["val_fraction"],
    )
    tok_dir = (resume / "tokenizer") if resume else (Path(cfg["output_dir"]) / "tokenizer")

    def tokenizer_files():
        if resume is None and accelerator.is_main_process:
            # a char vocabulary covers every split (like nanoGPT); a BPE is trained on the training text only
            tok_text = concatenate_datasets(list(raw.values())) if cfg["tokenizer"] == "char" else raw["train"]
            build_tokenizer(cfg["tokenizer"], tok_text, cfg["bpe_vocab_size"]).save_pretrained(tok_dir)
        return AutoTokenizer.from_pretrained(tok_dir)

    tokenizer = together(accelerator, tokenizer_files, "building the tokenizer", main_first=True)
    add_eos = cfg["add_eos"]
    if add_eos is None:  # rows are documents for .jsonl / hub data (wikitext lines keep their "\n")
        add_eos = bool(cfg["train_file"] and Path(cfg["train_file"]).suffix.lower() in (".jsonl", ".json"))
    if add_eos and tokenizer.eos_token_id is None:
        raise TrainingInputError("--add_eos true needs a tokenizer with an EOS token (the char tokenizer has none)")
    if cfg["eval_lm_harness"] and tokenizer.eos_token_id is None:
        raise TrainingInputError("--eval_lm_harness needs a tokenizer with an EOS token (lm-eval uses it as the "
                                 "end-of-text token; the char tokenizer has none): omit --tokenizer char")
    blocks = together(accelerator, lambda: tokenize_and_pack(raw, tokenizer, cfg["block_size"], add_eos=add_eos),
                      "tokenizing the data", main_first=True).with_format("torch")
    train_dl = DataLoader(blocks["train"], batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                          num_workers=cfg["num_workers"])
    val_dl = DataLoader(blocks["validation"], batch_size=cfg["batch_size"], shuffle=False,
                        num_workers=cfg["num_workers"])
    if len(train_dl) == 0:
        raise TrainingInputError(
            f"only {len(blocks['train'])} training blocks of {cfg['block_size']} tokens: fewer than --batch_size "
            f"{cfg['batch_size']}; lower batch_size/block_size or add data")
    return Data(raw, tokenizer, blocks, train_dl, val_dl)


def check_token_ids(blocks, vocab_size: int) -> None:
    """Every token id of the packed data must have an embedding: a clear error before training instead of
    torch's `IndexError: index out of range in self` (or a silent wrong lookup on a GPU)."""
    import pyarrow.compute as pc

    for split, ds in blocks.items():
        high = pc.max(pc.list_flatten(ds.data.column("input_ids"))).as_py()
        if high is not None and high >= vocab_size:
            raise TrainingInputError(
                f"token id {high} in the {split} data is outside the model's vocabulary of {vocab_size} ids (the "
                f"tokenizer produces ids its length does not count, or --model.vocab_size is too small): pass "
                f"--model.vocab_size {high + 1} (or more), or a tokenizer whose ids are below len(tokenizer)")


# ------------------------------------------------------------------------------------ model + optimizer
def build_model_and_optimizer(cfg: dict, accelerator, tokenizer):
    """The model (`--model_type`, sized by `model.*`), AdamW on the model's own parameter groups and the
    warmup + cosine schedule; not yet `accelerator.prepare`d."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from bilinear_lm.baselines import bilinear_config, build_model, optimizer_groups

    special = {k: getattr(tokenizer, k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    model_cfg = {**cfg[MODEL_KEY]}
    vocab_size = model_cfg.pop("vocab_size", None) or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise TrainingInputError(f"--model.vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} "
                                 f"tokens): omit it (default len(tokenizer)) or pass at least {len(tokenizer)}")
    if cfg["model_type"] == "bilinear":
        model_cfg.update({k: v for k, v in special.items() if v is not None})
    try:  # the baselines are sized from the bilinear config, so it must be valid for every model type
        bilinear_config(model_cfg, vocab_size)
    except (TypeError, ValueError) as err:
        raise TrainingInputError(f"--model.*: {err}") from None
    model = build_model(cfg["model_type"], model_cfg, vocab_size=vocab_size)
    for k, v in special.items():
        setattr(model.config, k, v)
        setattr(model.generation_config, k, v)
    transition_lr = cfg["learning_rate"] * cfg["transition_lr_scale"] if cfg["transition_lr_scale"] != 1 else None
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg["weight_decay"], transition_lr),
                                  lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]))
    # the prepared scheduler steps once per process per optimizer step (Accelerate convention)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg["warmup_steps"] * accelerator.num_processes,
        num_training_steps=cfg["max_steps"] * accelerator.num_processes, min_lr_rate=cfg["min_lr_ratio"],
    )
    return model, optimizer, scheduler


# ------------------------------------------------------------------------------------------------- loop
def evaluate(model, val_dl, accelerator, eval_iters: int | None) -> dict:
    """Mean validation loss (over ranks and the first `eval_iters` batches, 0 = all) and its perplexity."""
    import torch

    from bilinear_lm.utils import eval_mode

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
    epoch, minus what the epoch already consumed: a resumed run sees the batches an uninterrupted one would)."""
    while True:
        train_dl.set_epoch(state.epoch)
        loader = accelerator.skip_first_batches(train_dl, state.batches_done) if state.batches_done else train_dl
        for batch in loader:
            state.batches_done += 1
            yield batch
        state.epoch, state.batches_done = state.epoch + 1, 0


def train(cfg: dict, accelerator, model, optimizer, scheduler, data: Data, state: TrainState,
          metrics: MetricsLog) -> None:
    """Optimizer steps until `max_steps`: log every `log_interval`, evaluate every `eval_interval`, checkpoint
    every `save_interval` steps. Updates `state` in place."""
    from tqdm.auto import tqdm

    if state.step >= cfg["max_steps"]:
        return
    tokens_per_step = (cfg["batch_size"] * cfg["block_size"] * cfg["gradient_accumulation_steps"]
                       * accelerator.num_processes)
    pbar = tqdm(total=cfg["max_steps"], initial=state.step, disable=not accelerator.is_local_main_process,
                desc="train", dynamic_ncols=True)
    model.train()
    logged_step, logged_seconds = state.step, state.train_seconds  # where the throughput of the next log starts
    micro_losses, shard_sums = [], None  # this optimizer step's micro-batch losses; its first batch's checksums
    t_mark = time.time()
    for batch in micro_batches(accelerator, data.train_dl, state):
        lr = scheduler.get_last_lr()[0]  # the learning rate this step uses
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg["grad_clip"]:
                accelerator.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        micro_losses.append(loss.detach().float())
        if cfg["log_shard_checksums"] and len(micro_losses) == 1:
            shard_sums = accelerator.gather(batch["input_ids"].sum().reshape(1)).tolist()
        if not accelerator.sync_gradients:
            continue

        state.step += 1
        state.train_seconds += time.time() - t_mark
        pbar.update(1)
        if state.step % cfg["log_interval"] == 0 or state.step == cfg["max_steps"]:
            train_loss = accelerator.reduce(sum(micro_losses) / len(micro_losses), reduction="mean").item()
            tokens_per_sec = (tokens_per_step * (state.step - logged_step)
                              / max(state.train_seconds - logged_seconds, 1e-9))
            record = {"step": state.step, "loss": train_loss, "lr": lr, "train_seconds": state.train_seconds,
                      "tokens_per_sec": tokens_per_sec, "epoch": state.epoch}
            if cfg["log_shard_checksums"]:
                record["shard_checksums"] = shard_sums
            metrics.log(record)
            pbar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_sec:.0f}")
            logged_step, logged_seconds = state.step, state.train_seconds
        micro_losses = []

        if cfg["eval_interval"] and (state.step % cfg["eval_interval"] == 0 or state.step == cfg["max_steps"]):
            record = {"step": state.step, "train_seconds": state.train_seconds,
                      **evaluate(model, data.val_dl, accelerator, cfg["eval_iters"])}
            metrics.log(record)
            if accelerator.is_local_main_process:
                pbar.write(f"step {state.step}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.2f}")
        if cfg["save_interval"] and state.step % cfg["save_interval"] == 0:
            save_checkpoint(accelerator, cfg["output_dir"], state, data.tokenizer)
        t_mark = time.time()  # evaluation and checkpoint time is not training time
        if state.step >= cfg["max_steps"]:
            break
    pbar.close()


# ----------------------------------------------------------------------------------------------- finish
def print_sample(cfg: dict, model, tokenizer, raw, device) -> None:
    import torch

    prompt = cfg["sample_prompt"] or raw["validation"][0]["text"][:32] or "\n"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    model.eval()
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=cfg["sample_tokens"], do_sample=True, top_k=50,
                             pad_token_id=tokenizer.pad_token_id)
    print(f"--- sample ({cfg['sample_tokens']} tokens after the prompt {prompt!r}) ---")
    print(tokenizer.decode(gen[0], skip_special_tokens=True))
    print("---")


def run_harness(cfg: dict, model, tokenizer, out_dir: Path) -> None:
    from bilinear_lm.lm_harness import run_lm_eval  # imported here: lm-eval is needed only with --eval_lm_harness

    tasks = [t.strip() for t in cfg["eval_lm_harness"].split(",") if t.strip()]
    results = run_lm_eval(model, tokenizer, tasks, limit=cfg["lm_harness_limit"])  # {task: {metric: value}}
    (out_dir / "lm_harness.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"lm-eval-harness results written to {out_dir / 'lm_harness.json'}")


def finish(cfg: dict, accelerator, model, data: Data, state: TrainState, metrics: MetricsLog, n_params: int) -> dict:
    """save_pretrained (model, tokenizer, generation config), the final metrics record, loss.png, a sample and
    lm-eval; returns the final record."""
    unwrapped = accelerator.unwrap_model(model)
    final = {"step": state.step, "final": True,
             "params_identical_across_ranks": params_identical_across_ranks(accelerator, unwrapped),
             "num_processes": accelerator.num_processes, "n_params": n_params}
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    out_dir = Path(cfg["output_dir"])
    if accelerator.is_main_process:
        unwrapped.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        data.tokenizer.save_pretrained(out_dir)
        unwrapped.generation_config.save_pretrained(out_dir)
        append_metrics(metrics.path, final)
        plot_losses(metrics.path, out_dir / "loss.png")
        if cfg["sample_tokens"]:
            print_sample(cfg, unwrapped, data.tokenizer, data.raw, accelerator.device)
        if cfg["eval_lm_harness"]:
            run_harness(cfg, unwrapped, data.tokenizer, out_dir)
        print(f"saved model, tokenizer and generation config to {out_dir}")
    accelerator.end_training()
    return final


# ------------------------------------------------------------------------------------------------- main
def flat_config(cfg: dict) -> dict:
    """The config as tracker hyperparameters: scalars as they are, `model.KEY` for the model keys."""
    scalar = lambda v: v if isinstance(v, (int, float, str, bool)) else str(v)  # noqa: E731
    return {**{k: scalar(v) for k, v in cfg.items() if k != MODEL_KEY},
            **{f"{MODEL_KEY}.{k}": scalar(v) for k, v in cfg[MODEL_KEY].items()}}


def main(argv: list[str] | None = None) -> dict:
    """Train as configured by ``argv`` (the command line's arguments); returns the final metrics record.
    Bad input raises TrainingInputError or bilinear_lm.training.data.DataError."""
    cfg = parse_config(sys.argv[1:] if argv is None else argv)

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from bilinear_lm.baselines import count_parameters

    out_dir = Path(cfg["output_dir"])
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        mixed_precision=cfg["mixed_precision"],
        log_with=None if cfg["report_to"] in (None, "none") else cfg["report_to"],
        project_dir=str(out_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg["seed"]),
    )
    warning = bf16_cpu_warning(cfg["mixed_precision"], accelerator.device.type)
    if warning:
        accelerator.print(warning)
    set_seed(cfg["seed"])
    resume = find_checkpoint(cfg["output_dir"], cfg["resume_from_checkpoint"]) if cfg["resume_from_checkpoint"] else None
    if cfg["resume_from_checkpoint"] == "latest" and resume is None:
        accelerator.print(f"no complete checkpoint in {out_dir}/checkpoints: starting from scratch")
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)

    data = load_data(cfg, accelerator, resume)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, accelerator, data.tokenizer)
    check_token_ids(data.blocks, model.config.vocab_size)
    n_params = count_parameters(model)
    global_batch = cfg["batch_size"] * accelerator.num_processes * cfg["gradient_accumulation_steps"]
    accelerator.print(
        f"{cfg['model_type']} model: {n_params / 1e6:.3f}M parameters, vocab {model.config.vocab_size}, "
        f"{len(data.blocks['train'])} train / {len(data.blocks['validation'])} val blocks of {cfg['block_size']}\n"
        f"{accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''} "
        f"({accelerator.distributed_type.value}), global batch {global_batch} sequences = batch_size "
        f"{cfg['batch_size']} x {accelerator.num_processes} processes x {cfg['gradient_accumulation_steps']} "
        f"accumulation steps ({global_batch * cfg['block_size']} tokens per optimizer step)")
    model, optimizer, data.train_dl, data.val_dl, scheduler = accelerator.prepare(
        model, optimizer, data.train_dl, data.val_dl, scheduler)

    state = TrainState()
    if resume is not None:
        accelerator.load_state(str(resume))
        state = TrainState.load(resume)
        accelerator.print(f"resumed from {resume} at step {state.step} (epoch {state.epoch}, batch "
                          f"{state.batches_done}, {state.train_seconds:.1f} s of training)")
    metrics = MetricsLog(accelerator, out_dir / "metrics.jsonl")
    metrics.start(resumed_at=state.step if resume is not None else None)
    if accelerator.log_with:
        accelerator.init_trackers("bilinear_lm", config=flat_config(cfg))

    train(cfg, accelerator, model, optimizer, scheduler, data, state, metrics)
    return finish(cfg, accelerator, model, data, state, metrics, n_params)


def cli(argv: list[str] | None = None) -> int:
    """The command line: --help, or train; bad input is one line on stderr and exit status 1 (anything else is a
    bug and keeps its traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    from bilinear_lm.training.data import DataError

    try:
        main(argv)
    except (TrainingInputError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
