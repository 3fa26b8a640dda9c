"""Train a bilinear recurrent LM (or a parameter-matched Llama / Mamba baseline) with Accelerate.

    accelerate launch train.py --config bilinear_lm/configs/tiny.yaml [--key value ...] [--model.key value ...]

Single process, N GPUs (`accelerate launch --multi_gpu --num_processes N`), CPU DDP
(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`) and FSDP
(`accelerate launch --config_file bilinear_lm/configs/accelerate/fsdp.yaml`) all run this same file.

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop (log, eval, checkpoint) -> save.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

# ------------------------------------------------------------------------------------------------ config
# Every training key, its default and its type. A preset (YAML) overrides these; the command line overrides
# the preset. `model:` holds BilinearConfig kwargs (vocab_size comes from the tokenizer).
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
    "model_type": ("bilinear", str),        # bilinear | llama | mamba
    "batch_size": (16, int),                # per process, per micro-step
    "gradient_accumulation_steps": (1, int),
    "max_steps": (1000, int),
    "learning_rate": (1e-3, float),
    "min_lr_ratio": (0.1, float),           # cosine decays to learning_rate * min_lr_ratio
    "warmup_steps": (100, int),
    "weight_decay": (0.1, float),           # on matrices only (not norms / biases)
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
        raise ValueError(f"--{key}: expected true/false, got {value!r}")
    if typ is object:  # model key without a known type: parse like YAML
        return yaml.safe_load(value) if isinstance(value, str) else value
    try:
        if typ is int and isinstance(value, str) and any(c in value for c in ".eE"):
            as_float = float(value)
            if as_float != int(as_float):
                raise ValueError
            return int(as_float)
        return typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"--{key}: expected {typ.__name__}, got {value!r}") from None


def _model_key_types(preset_model: dict) -> dict[str, type]:
    """Valid `model.*` keys: the BilinearConfig fields (typed by the preset value when present)."""
    from bilinear_lm import BilinearConfig

    types: dict[str, type] = {}
    for klass in reversed(BilinearConfig.__mro__):
        for name in getattr(klass, "__annotations__", {}):
            if name == "vocab_size" or name.startswith("_"):
                continue
            types[name] = object
    for name, value in preset_model.items():
        if value is not None and name in types:
            types[name] = type(value) if not isinstance(value, bool) else bool
    return types


def parse_config(argv: list[str]) -> dict:
    """DEFAULTS <- YAML preset (--config) <- `--key value` / `--model.key value` overrides."""
    args = list(argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        print("training keys (default):")
        for k, (d, t) in DEFAULTS.items():
            print(f"  --{k:<28} {t.__name__:<6} {d!r}")
        print("model keys: --model.<BilinearConfig field>, e.g. --model.hidden_size 128 --model.num_hidden_layers 4")
        raise SystemExit(0)
    preset: dict = {}
    if "--config" in args or any(a.startswith("--config=") for a in args):
        i = next(i for i, a in enumerate(args) if a == "--config" or a.startswith("--config="))
        path = args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else None)
        del args[i : i + (1 if "=" in args[i] else 2)]
        if not path or not Path(path).is_file():
            raise SystemExit(f"--config {path!r}: preset file not found (presets live in bilinear_lm/configs/)")
        preset = yaml.safe_load(Path(path).read_text()) or {}
    unknown = [k for k in preset if k not in DEFAULTS and k != MODEL_KEY]
    if unknown:
        raise SystemExit(f"unknown key(s) {unknown} in the preset; valid keys: {sorted(DEFAULTS)} and model.*")

    cfg = {k: _coerce(k, preset.get(k, d), t) for k, (d, t) in DEFAULTS.items()}
    model_cfg = dict(preset.get(MODEL_KEY) or {})
    model_types = _model_key_types(model_cfg)
    bad_model = [k for k in model_cfg if k not in model_types]
    if bad_model:
        raise SystemExit(f"unknown model key(s) {bad_model} in the preset; valid model keys: {sorted(model_types)}")

    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r}: overrides look like --key value or --model.key value")
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
                raise SystemExit(f"unknown model key {name!r}; valid model keys: {sorted(model_types)}")
            model_cfg[name] = _coerce(key, value, model_types[name])
        elif key in DEFAULTS:
            cfg[key] = _coerce(key, value, DEFAULTS[key][1])
        else:
            raise SystemExit(
                f"unknown config key {key!r}; valid keys: {sorted(DEFAULTS)} (and --model.<key> for "
                f"{sorted(model_types)})"
            )
    cfg[MODEL_KEY] = model_cfg
    if cfg["block_size"] is None or cfg["block_size"] < 1:
        raise SystemExit(f"--block_size must be a positive integer, got {cfg['block_size']}")
    if cfg["model_type"] not in ("bilinear", "llama", "mamba"):
        raise SystemExit(f"--model_type must be bilinear, llama or mamba, got {cfg['model_type']!r}")
    return cfg


# ----------------------------------------------------------------------------------------- checkpoints
DONE_MARKER = "CHECKPOINT_COMPLETE"


def find_checkpoint(output_dir: str, spec: str) -> Path | None:
    """`latest` -> newest complete OUTPUT_DIR/checkpoints/step_N (None if there is none); else a path."""
    if spec == "latest":
        done = [p for p in (Path(output_dir) / "checkpoints").glob("step_*") if (p / DONE_MARKER).exists()]
        return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)
    path = Path(spec)
    if not (path / DONE_MARKER).exists():
        raise SystemExit(f"--resume_from_checkpoint {spec!r}: not a complete checkpoint directory "
                         f"(expected {path / DONE_MARKER}); use 'latest' or OUTPUT_DIR/checkpoints/step_N")
    return path


def save_checkpoint(accelerator, output_dir: str, step: int, trainer_state: dict, tokenizer) -> None:
    """accelerator.save_state into a temporary directory, marker written last, then an atomic rename."""
    final = Path(output_dir) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(f".tmp_step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, scheduler, RNG states of every rank
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        with open(tmp / DONE_MARKER, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------- metrics
def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
    from datasets import concatenate_datasets
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, get_cosine_with_min_lr_schedule_with_warmup

    from bilinear_lm.baselines import build_model, count_parameters
    from bilinear_lm.data import build_tokenizer, load_raw_text, tokenize_and_pack

    out_dir = Path(cfg["output_dir"])
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        mixed_precision=cfg["mixed_precision"],
        log_with=None if cfg["report_to"] in (None, "none") else cfg["report_to"],
        project_dir=str(out_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg["seed"]),
    )
    print_main = accelerator.print
    set_seed(cfg["seed"])
    resume = find_checkpoint(cfg["output_dir"], cfg["resume_from_checkpoint"]) if cfg["resume_from_checkpoint"] else None
    if cfg["resume_from_checkpoint"] == "latest" and resume is None:
        print_main(f"no complete checkpoint in {out_dir}/checkpoints: starting from scratch")
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------------------------------------- data
    raw = load_raw_text(
        dataset=None if cfg["train_file"] or cfg["dataset"] in (None, "none") else cfg["dataset"],
        dataset_config=cfg["dataset_config"], train_file=cfg["train_file"],
        validation_file=cfg["validation_file"], text_column=cfg["text_column"], val_fraction=cfg["val_fraction"],
    )
    tok_dir = (resume / "tokenizer") if resume else (out_dir / "tokenizer")
    if resume is None and accelerator.is_main_process:  # build once, every rank loads the same files
        # a char vocabulary covers every split (like nanoGPT); a BPE is trained on the training text only
        tok_text = concatenate_datasets(list(raw.values())) if cfg["tokenizer"] == "char" else raw["train"]
        build_tokenizer(cfg["tokenizer"], tok_text, cfg["bpe_vocab_size"]).save_pretrained(tok_dir)
    accelerator.wait_for_everyone()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    add_eos = cfg["add_eos"]
    if add_eos is None:  # rows are documents for .jsonl / hub data (wikitext lines keep their "\n")
        add_eos = bool(cfg["train_file"] and Path(cfg["train_file"]).suffix.lower() in (".jsonl", ".json"))
    if add_eos and tokenizer.eos_token_id is None:
        raise SystemExit("--add_eos true needs a tokenizer with an EOS token (the char tokenizer has none)")
    with accelerator.main_process_first():
        blocks = tokenize_and_pack(raw, tokenizer, cfg["block_size"], add_eos=add_eos).with_format("torch")
    train_dl = DataLoader(blocks["train"], batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                          num_workers=cfg["num_workers"])
    val_dl = DataLoader(blocks["validation"], batch_size=cfg["batch_size"], shuffle=False,
                        num_workers=cfg["num_workers"])
    if len(train_dl) == 0:
        raise SystemExit(f"only {len(blocks['train'])} training blocks of {cfg['block_size']} tokens: fewer than "
                         f"--batch_size {cfg['batch_size']}; lower batch_size/block_size or add data")

    # ------------------------------------------------------------------------------------------- model
    special = {k: getattr(tokenizer, k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    model_cfg = {**cfg[MODEL_KEY]}
    if cfg["model_type"] == "bilinear":
        model_cfg.update({k: v for k, v in special.items() if v is not None})
    model = build_model(cfg["model_type"], model_cfg, vocab_size=len(tokenizer))
    for k, v in special.items():
        setattr(model.config, k, v)
        setattr(model.generation_config, k, v)
    n_params = count_parameters(model)
    print_main(f"{cfg['model_type']} model: {n_params / 1e6:.3f}M parameters, vocab {len(tokenizer)}, "
               f"{len(blocks['train'])} train / {len(blocks['validation'])} val blocks of {cfg['block_size']}")

    # --------------------------------------------------------------------------------------- optimizer
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
    )
    # the prepared scheduler steps once per process per optimizer step (Accelerate convention)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg["warmup_steps"] * accelerator.num_processes,
        num_training_steps=cfg["max_steps"] * accelerator.num_processes, min_lr_rate=cfg["min_lr_ratio"],
    )
    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, val_dl, scheduler)

    # ------------------------------------------------------------------------------------------ resume
    step, epoch, batches_done = 0, 0, 0  # optimizer steps; epoch; micro-batches consumed in this epoch
    metrics_path = out_dir / "metrics.jsonl"
    if resume is not None:
        accelerator.load_state(str(resume))
        state = json.loads((resume / "trainer_state.json").read_text())
        step, epoch, batches_done = state["step"], state["epoch"], state["batches_done"]
        print_main(f"resumed from {resume} at step {step} (epoch {epoch}, batch {batches_done})")
        if accelerator.is_main_process and metrics_path.exists():  # drop records past the checkpoint
            keep = [ln for ln in metrics_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            metrics_path.write_text("".join(ln + "\n" for ln in keep))
    elif accelerator.is_main_process and metrics_path.exists():
        metrics_path.unlink()
    if accelerator.log_with:
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.items() if k != MODEL_KEY}
        flat.update({f"model.{k}": (v if isinstance(v, (int, float, str, bool)) else str(v))
                     for k, v in cfg[MODEL_KEY].items()})
        accelerator.init_trackers("bilinear_lm", config=flat)

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        losses = []
        for i, batch in enumerate(val_dl):
            if cfg["eval_iters"] and i >= cfg["eval_iters"]:
                break
            loss = model(**batch).loss
            losses.append(accelerator.gather(loss.detach().float().reshape(1)))  # one batch mean per rank
        model.train()
        val_loss = torch.cat(losses).mean().item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def log(record: dict) -> None:
        if accelerator.is_main_process:
            append_metrics(metrics_path, record)
        accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=record["step"])

    # -------------------------------------------------------------------------------------------- loop
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * cfg["gradient_accumulation_steps"] * accelerator.num_processes
    pbar = tqdm(total=cfg["max_steps"], initial=step, disable=not accelerator.is_local_main_process, desc="train",
                dynamic_ncols=True)
    model.train()
    # train_seconds: wall-clock spent in training steps by this process (evaluation and checkpoints excluded)
    t_mark, train_seconds, logged_seconds = time.time(), 0.0, 0.0
    steps_since, loss_sum, n_micro = 0, None, 0
    while step < cfg["max_steps"]:
        train_dl.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_dl, batches_done) if batches_done else train_dl
        for batch in loader:
            lr = scheduler.get_last_lr()[0]  # the learning rate this step uses
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg["grad_clip"]:
                    accelerator.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            batches_done += 1
            loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
            n_micro += 1
            if cfg["log_shard_checksums"] and n_micro == 1:
                shard_sums = accelerator.gather(batch["input_ids"].sum().reshape(1)).tolist()
            if not accelerator.sync_gradients:
                continue

            step += 1
            steps_since += 1
            pbar.update(1)
            now = time.time()
            train_seconds, t_mark = train_seconds + now - t_mark, now
            if step % cfg["log_interval"] == 0 or step == cfg["max_steps"]:
                train_loss = accelerator.reduce(loss_sum / n_micro, reduction="mean").item()  # mean over ranks
                dt, logged_seconds = train_seconds - logged_seconds, train_seconds
                record = {"step": step, "loss": train_loss, "lr": lr, "train_seconds": train_seconds,
                          "tokens_per_sec": tokens_per_step * steps_since / max(dt, 1e-9), "epoch": epoch}
                if cfg["log_shard_checksums"]:
                    record["shard_checksums"] = shard_sums
                log(record)
                pbar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
                steps_since = 0
            loss_sum, n_micro = None, 0

            if cfg["eval_interval"] and (step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]):
                record = {"step": step, "train_seconds": train_seconds, **evaluate()}
                log(record)
                pbar.write(f"step {step}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.2f}") \
                    if accelerator.is_local_main_process else None
            if cfg["save_interval"] and step % cfg["save_interval"] == 0:
                save_checkpoint(accelerator, cfg["output_dir"], step,
                                {"step": step, "epoch": epoch, "batches_done": batches_done}, tokenizer)
            t_mark = time.time()  # evaluation and checkpoint time is not training time
            if step >= cfg["max_steps"]:
                break
        else:  # epoch exhausted
            epoch, batches_done = epoch + 1, 0
            continue
        break
    pbar.close()

    # -------------------------------------------------------------------------------------------- save
    # DDP sanity check: every rank must hold identical parameters
    unwrapped = accelerator.unwrap_model(model)
    params_identical = None  # FSDP: parameters are sharded, nothing to compare
    if accelerator.distributed_type != DistributedType.FSDP:
        checksum = torch.stack([p.detach().double().sum() for p in unwrapped.parameters()]).reshape(1, -1)
        all_checksums = accelerator.gather(checksum)
        params_identical = bool((all_checksums == all_checksums[0]).all().item())
    final = {"step": step, "final": True, "params_identical_across_ranks": params_identical,
             "num_processes": accelerator.num_processes, "n_params": n_params}
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        unwrapped.generation_config.save_pretrained(out_dir)
        append_metrics(metrics_path, final)
        plot_losses(metrics_path, out_dir / "loss.png")
        if cfg["sample_tokens"]:
            prompt = cfg["sample_prompt"] or raw["validation"][0]["text"][:32] or "\n"
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(accelerator.device)
            unwrapped.eval()
            with torch.no_grad():
                gen = unwrapped.generate(ids, max_new_tokens=cfg["sample_tokens"], do_sample=True, top_k=50,
                                         pad_token_id=tokenizer.pad_token_id)
            print(f"--- sample ({cfg['sample_tokens']} tokens after the prompt {prompt!r}) ---")
            print(tokenizer.decode(gen[0], skip_special_tokens=True))
            print("---")
        if cfg["eval_lm_harness"]:
            from bilinear_lm.lm_harness import run_lm_eval  # owned by the eval area; imported lazily

            tasks = [t.strip() for t in cfg["eval_lm_harness"].split(",") if t.strip()]
            results = run_lm_eval(unwrapped, tokenizer, tasks, limit=cfg["lm_harness_limit"])
            (out_dir / "lm_harness.json").write_text(json.dumps(results, indent=1, default=str))
            print(f"lm-eval-harness results written to {out_dir / 'lm_harness.json'}")
        print(f"saved model, tokenizer and generation config to {out_dir}")
    accelerator.end_training()
    return final


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:  # bad input from the data pipeline: one clear line, not a traceback
        raise SystemExit(f"error: {err}") from None
