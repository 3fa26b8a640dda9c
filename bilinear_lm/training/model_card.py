"""The model card (README.md) written with every final model, in the form the Hub reads (`huggingface_hub.ModelCard`:
YAML metadata, then Markdown), so that the output folder can be pushed as it is:

    write_model_card(out_dir, cfg, model, n_params, records)   # OUTPUT_DIR/README.md; ModelCard.load reads it

The card says what the model is (the config), what it was trained on and how (the data, the command), how well it
did (the final metrics of metrics.jsonl, lm-eval's when it ran) and how to load it, with and without this package.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from .config import Config
from .data import DEFAULT_TRAIN_FILE
from .metrics import last_value

# the model's config fields the card's table lists, when the model has them
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_layers", "num_heads", "state_size", "rank",
                 "mixer_type", "intermediate_size", "conv_width", "use_mlp", "use_gate", "tie_word_embeddings",
                 "layer_types", "num_attention_heads", "num_key_value_heads")


def _versions() -> dict:
    import accelerate
    import torch
    import transformers

    import bilinear_lm

    return {"bilinear-lm": bilinear_lm.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "accelerate": accelerate.__version__}


def training_command(cfg: Config, environ=os.environ) -> str:
    """How train.py was run: its arguments, under `accelerate launch` when the launcher started it (its own flags
    are not known to train.py)."""
    launcher = "accelerate launch" if "ACCELERATE_DYNAMO_BACKEND" in environ else "python"
    return f"{launcher} train.py {shlex.join(cfg.argv)}".rstrip()


def _data(cfg: Config) -> tuple[str, list[str] | None]:
    """The training data in words, and the Hub datasets for the metadata."""
    if cfg.data.train_file:
        what = f"local files `{cfg.data.train_file}`"
    elif cfg.data.dataset:
        what = f"the Hub dataset [{cfg.data.dataset}](https://huggingface.co/datasets/{cfg.data.dataset})" + (
            f" ({cfg.data.dataset_config})" if cfg.data.dataset_config else "")
    else:
        what = f"Tiny Shakespeare (`{Path(DEFAULT_TRAIN_FILE).name}`, 1.1 MB, shipped with bilinear-lm)"
    held_out = (f"validation: `{cfg.data.validation_file}`" if cfg.data.validation_file
                else "validation: the dataset's validation split" if cfg.data.dataset and not cfg.data.train_file
                else f"validation: the last {cfg.data.val_fraction:.0%} of the training text")
    tokenizer = {"bpe": f"a byte-level BPE of {cfg.data.bpe_vocab_size} tokens trained on the training text",
                 "char": "one token per character of the text"}.get(cfg.data.tokenizer, f"`{cfg.data.tokenizer}`")
    hub = [cfg.data.dataset] if cfg.data.dataset and not cfg.data.train_file and not Path(cfg.data.dataset).exists() \
        else None
    return f"{what}; {held_out}; tokenizer: {tokenizer}; blocks of {cfg.data.block_size} tokens", hub


def _usage(model_type: str) -> str:
    if model_type == "lstm":
        return ("```python\nfrom bilinear_lm.baselines import LSTMLanguageModel   # pip install bilinear-lm\n"
                "from transformers import AutoTokenizer\n\nmodel = LSTMLanguageModel.from_pretrained(PATH)\n"
                "tokenizer = AutoTokenizer.from_pretrained(PATH)\n```\n")
    generate = ('\nids = tokenizer("To be", return_tensors="pt").input_ids\n'
                "print(tokenizer.decode(model.generate(ids, max_new_tokens=50, do_sample=True, top_k=50)[0]))\n")
    if model_type == "gated_deltanet":  # Qwen3.5's, behind the adapter saved in the folder
        return ("The adapter around transformers' Qwen3.5 (`modeling_gated_deltanet.py`) is saved in this folder and "
                "runs as remote code, with or without the package:\n\n"
                "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)\n"
                "tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)   # else it asks y/N on a "
                f"terminal{generate}```\n")
    if model_type != "bilinear":  # transformers' own Llama / Mamba / Mamba2
        return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"model = AutoModelForCausalLM.from_pretrained(PATH)\ntokenizer = AutoTokenizer.from_pretrained(PATH)"
                f"{generate}```\n")
    return ("With the package (`pip install bilinear-lm`: the C++ CPU kernels and the Triton GPU kernels):\n\n"
            "```python\nimport bilinear_lm   # registers model_type \"bilinear\" with the Auto classes\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained(PATH)\ntokenizer = AutoTokenizer.from_pretrained(PATH)"
            f"{generate}```\n\n"
            "Without it, the modeling code saved in this folder runs as remote code (the PyTorch scan):\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)\n"
            "tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)   # else it asks y/N on a "
            "terminal\n```\n")


def model_card(cfg: Config, model, n_params: int, records: list[dict], harness: dict | None = None,
               environ=os.environ):
    """The card of a final model (`huggingface_hub.ModelCard`): ``model`` (its config), ``records`` (metrics.jsonl),
    ``harness`` (lm-eval's results, {task: {metric: value}})."""
    from huggingface_hub import ModelCard, ModelCardData

    model_type = cfg.train.model_type
    config = model.config
    data, hub_datasets = _data(cfg)
    train, val = last_value(records, "loss"), last_value(records, "val_loss")
    final = last_value(records, "final") or {}
    step = final.get("step") or (train or {}).get("step", 0)
    processes = final.get("num_processes", 1)
    tokens = step * cfg.train.batch_size * cfg.train.gradient_accumulation_steps * processes * cfg.data.block_size
    remote_code = model_type in ("bilinear", "gated_deltanet")  # the folder holds modeling code
    tags = ["bilinear-lm", "recurrent", "text-generation"] + (["custom_code"] if remote_code else [])
    metadata = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=tags,
                             datasets=hub_datasets, model_name=Path(cfg.train.output_dir).resolve().name)

    rows = [("parameters", f"{n_params:,} (tied embeddings counted once)")]
    attention = set(getattr(config, "layer_types", None) or ["bilinear"]) != {"bilinear"}  # a hybrid
    rows += [(key, json.dumps(getattr(config, key)) if isinstance(getattr(config, key), list)
              else str(getattr(config, key))) for key in CONFIG_FIELDS if hasattr(config, key)
             and (attention or key not in ("layer_types", "num_attention_heads", "num_key_value_heads")
                  or model_type != "bilinear")]
    results = [("steps", f"{step:,} ({tokens:,} tokens)")]
    if train:
        results.append(("final training loss", f"{train['loss']:.4f} (step {train['step']})"))
    if val:
        results += [("validation loss", f"{val['val_loss']:.4f} (step {val['step']})"),
                    ("validation perplexity", f"{val['val_ppl']:.2f}")]
    if train and train.get("train_seconds"):
        results.append(("training time", f"{train['train_seconds']:.0f} s ({tokens / train['train_seconds']:,.0f} "
                                          f"tokens/s, {processes} process{'es' if processes > 1 else ''})"))
    peaks = [r["peak_rss_mib"] for r in records if "peak_rss_mib" in r]
    if peaks:
        results.append(("peak memory (RSS, main process)", f"{max(peaks):,.0f} MiB"))
    for task, metrics in (harness or {}).items():
        results += [(f"lm-eval {task} {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
                    for name, value in metrics.items() if not name.endswith("stderr")]
    table = lambda pairs: "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in pairs)  # noqa: E731
    optimization = (f"{step:,} optimizer steps of {cfg.train.batch_size * cfg.train.gradient_accumulation_steps * processes}"
                    f" sequences x {cfg.data.block_size} tokens, AdamW (learning rate {cfg.train.learning_rate:g}, "
                    f"{cfg.train.warmup_steps} warmup steps, cosine to {cfg.train.min_lr_ratio:g} x, weight decay "
                    f"{cfg.train.weight_decay:g}), mixed precision {cfg.train.mixed_precision or 'no'}, seed "
                    f"{cfg.train.seed}")
    versions = ", ".join(f"{name} {version}" for name, version in _versions().items())
    description = {"bilinear": "a bilinear recurrent language model (multiplicative state transitions)",
                   "llama": "transformers' `LlamaForCausalLM`, a baseline of about the bilinear model's size",
                   "gated_deltanet": "Gated DeltaNet (transformers' `Qwen3_5ForCausalLM` text model, through "
                                     "`bilinear_lm.baselines.GatedDeltaNetForCausalLM`), a peer of about the bilinear "
                                     "model's size",
                   "mamba2": "transformers' `Mamba2ForCausalLM`, a peer of about the bilinear model's size",
                   "mamba": "transformers' `MambaForCausalLM`, a baseline of about the bilinear model's size",
                   "lstm": "an LSTM language model (`bilinear_lm.baselines.LSTMLanguageModel`), a baseline"}[model_type]
    body = f"""# {metadata.model_name}

{description[0].upper() + description[1:]}, {n_params:,} parameters, trained with `train.py` of
bilinear-lm {_versions()['bilinear-lm']}.

## Model

{table(rows)}
## Training data

{data}.

## Training

```bash
{training_command(cfg, environ)}
```

{optimization}. The full configuration is in the checkpoints' `training_config.json`, the losses in `metrics.jsonl`
and `loss.png`.

## Results

{table(results)}
## How to use

`PATH` is this folder (or its Hub repository).

{_usage(model_type)}
## Versions

{versions}.
"""
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n{body}")


def write_model_card(out_dir: Path, cfg: Config, model, n_params: int, records: list[dict]) -> Path:
    """OUTPUT_DIR/README.md: the model card of the model saved there (lm-eval's results included when
    lm_harness.json is there)."""
    harness_file = Path(out_dir) / "lm_harness.json"
    harness = json.loads(harness_file.read_text()) if harness_file.is_file() else None
    path = Path(out_dir) / "README.md"
    model_card(cfg, model, n_params, records, harness).save(path)
    return path
