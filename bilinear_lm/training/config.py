"""train.py's configuration: two dataclasses read by transformers' `HfArgumentParser`, a YAML preset under them,
and `--model.KEY VALUE` overrides of `BilinearConfig` fields.

    cfg = parse_config(["--config", "bilinear_lm/configs/tiny.yaml", "--max_steps", "100", "--model.conv_width", "4"])
    cfg.data.block_size, cfg.train.max_steps, cfg.model   # 128, 100, {"hidden_size": 128, ..., "conv_width": 4}

Each key's value is its dataclass default, else the preset's (`--config`), else the command line's. A preset is
the command line written down: every `key: value` is read as `--key=value`, `model:` entries as
`--model.key=value`, and a `null` leaves the key at its default. Unknown keys and values of the wrong type raise
`TrainingInputError` naming the key, which train.py prints as one line.
"""
import difflib
import json
import logging
import os
import re
import types
import typing
from argparse import ArgumentDefaultsHelpFormatter, ArgumentTypeError, RawDescriptionHelpFormatter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import HfArg, string_to_bool

from bilinear_lm import GATED_DELTANET_OPTIONS, MODEL_TYPES, BilinearConfig

logger = logging.getLogger(__name__)
MODEL_PREFIX = "--model."
NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?", re.IGNORECASE)


def default_num_proc() -> int:
    """Processes for tokenizing: the CPU cores this process may use, at most 8."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


class TrainingInputError(ValueError):
    """Unusable user input to train.py (config keys and values, checkpoint paths, data that does not fit the model);
    the message says what to pass instead. The command line prints it as one line; anything else is a bug and keeps
    its traceback. (Data-pipeline problems raise `bilinear_lm.training.data.DataError`, printed the same way.)"""


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and packed."""

    _argument_group_name = "data"

    dataset: str | None = HfArg(default=None, help="Hub dataset, e.g. roneneldan/TinyStories (its rows are "
                                "documents); with neither this nor --train_file, the Tiny Shakespeare text shipped "
                                "with the package")
    dataset_config: str | None = HfArg(default=None, help="the Hub dataset's configuration")
    train_file: str | None = HfArg(default=None, help="a local file or a folder of files (.txt, .jsonl, .jsonl.gz, "
                                   ".json, .parquet); wins over --dataset")
    validation_file: str | None = HfArg(default=None, help="default: the last --val_fraction of the training text")
    text_column: str = HfArg(default="text", help="the text field of .jsonl / Hub rows")
    val_fraction: float = HfArg(default=0.1, help="held-out tail when there is no validation split")
    add_eos: bool | None = HfArg(default=None, help="append EOS after every row; default: for JSON / Parquet files and "
                                 "Hub datasets (rows are documents), not for .txt files (lines)")
    tokenizer: str = HfArg(default="bpe", help="bpe (a byte-level BPE trained on the training text), char, or a Hub "
                           "name / local directory")
    bpe_vocab_size: int = HfArg(default=8192, help="vocabulary of the trained BPE")
    block_size: int = HfArg(default=256, help="tokens per training sequence")
    num_workers: int = HfArg(default=0, help="DataLoader worker processes")
    num_proc: int = HfArg(default_factory=default_num_proc, help="processes tokenizing the data (once: the result is "
                          "cached on disk by `datasets`); default: the usable CPU cores, at most 8")
    streaming: bool = HfArg(default=False, help="read, tokenize and pack the training data as training goes (a corpus "
                            "larger than the disk): in order, no shuffling; needs a validation split")

    def __post_init__(self):
        for key in ("block_size", "num_proc"):
            if getattr(self, key) < 1:
                raise TrainingInputError(f"--{key} must be a positive integer, got {getattr(self, key)}")
        if self.streaming and self.num_workers:
            raise TrainingInputError("--streaming reads the data in the training process (so that a checkpoint records "
                                     "the position): pass --num_workers 0")


@dataclass
class TrainConfig:
    """The model type, optimization, logging, evaluation and checkpoints."""

    _argument_group_name = "training"

    config: str | None = HfArg(default=None, help="a YAML preset (bilinear_lm/configs/); the command line overrides "
                               "it")
    model_type: Literal[MODEL_TYPES] = HfArg(default="bilinear", help="the bilinear LM, or a baseline of about its "
                                             "parameter count (gated_deltanet: --model.allow_neg_eigval true gives "
                                             "its [-1, 1] form, --model.dt_bias_init qwen3_5 transformers' "
                                             "initialization)")
    batch_size: int = HfArg(default=16, help="sequences per process and micro-step")
    gradient_accumulation_steps: int = HfArg(default=1, help="micro-steps per optimizer step")
    max_steps: int = HfArg(default=1000, help="optimizer steps")
    learning_rate: float = HfArg(default=1e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = HfArg(default=0.1, help="the cosine schedule ends at learning_rate * min_lr_ratio")
    warmup_steps: int = HfArg(default=100, help="linear warmup steps")
    weight_decay: float = HfArg(default=0.1, help="on matrices only (the model's optimizer_groups)")
    beta1: float = HfArg(default=0.9, help="AdamW beta1")
    beta2: float = HfArg(default=0.95, help="AdamW beta2")
    grad_clip: float = HfArg(default=1.0, help="gradient norm clip (0 disables)")
    mixed_precision: Literal["no", "bf16", "fp16"] | None = HfArg(
        default=None, help="autocast precision; default: the launcher's (`accelerate launch --mixed_precision` or its "
                           "config file) unless no, else the preset's, else no")
    seed: int = HfArg(default=1337, help="initialization, data order and sampling seed")
    output_dir: str = HfArg(default="out", help="metrics, checkpoints, loss plot and the final model; one live run "
                            "at a time (a lock)")
    overwrite_output_dir: bool = HfArg(default=False, help="delete another run's results (checkpoints, metrics.jsonl, "
                                       "the final model) in --output_dir before this run starts afresh there; without "
                                       "it such a run is refused (--resume_from_checkpoint continues the folder's run)")
    log_interval: int = HfArg(default=10, help="steps between training-loss records")
    eval_interval: int = HfArg(default=200, help="steps between validations (0 = none)")
    eval_iters: int = HfArg(default=50, help="validation batches per evaluation (0 = the whole split)")
    save_interval: int = HfArg(default=500, help="steps between checkpoints (0 = only the final model)")
    save_total_limit: int = HfArg(default=3, help="keep the newest N complete checkpoints, delete older ones after "
                                  "each save (0 = keep all); 3 leaves two to fall back to when the newest is damaged")
    resume_from_checkpoint: str | None = HfArg(default=None, help="latest (the newest complete checkpoint that "
                                               "matches its manifest; damaged ones are skipped with a warning), or "
                                               "OUTPUT_DIR/checkpoints/step_N")
    allow_config_change: bool = HfArg(default=False, help="resume with other data, batching or optimization options "
                                      "than the checkpoint's (the model options must always match)")
    report_to: str = HfArg(default="none", help="Accelerate trackers: none, tensorboard, wandb, ...")
    sample_tokens: int = HfArg(default=200, help="tokens generated at the end (0 = no sample)")
    sample_prompt: str | None = HfArg(default=None, help="default: the start of the validation text")
    eval_lm_harness: str | None = HfArg(default=None, help="comma-separated lm-eval tasks run on the final model")
    lm_harness_limit: int | None = HfArg(default=None, help="examples per lm-eval task")

    def __post_init__(self):
        for key in ("batch_size", "gradient_accumulation_steps", "log_interval"):
            if getattr(self, key) < 1:
                raise TrainingInputError(f"--{key} must be a positive integer, got {getattr(self, key)}")
        if self.save_total_limit < 0:
            raise TrainingInputError(f"--save_total_limit must be 0 (keep all) or positive, got "
                                     f"{self.save_total_limit}")
        if self.learning_rate < 0:
            raise TrainingInputError(f"--learning_rate must be >= 0, got {self.learning_rate}: pass the peak learning "
                                     f"rate as a positive number, e.g. --learning_rate 1e-3")
        if self.learning_rate == 0:
            logger.warning("WARNING: --learning_rate 0: the weights will not change (training runs anyway); pass a "
                           "positive learning rate to train")


class Config(NamedTuple):
    """A training run's configuration: `data`, `train` and `model` (BilinearConfig overrides; the baselines are
    sized from them); which setting chose `train.mixed_precision` (`resolve_mixed_precision`), and the command line's
    arguments it was parsed from."""

    data: DataConfig
    train: TrainConfig
    model: dict
    mixed_precision_from: str = "the default"
    argv: tuple = ()


def model_key_types() -> dict[str, type]:
    """Valid `--model.KEY`s and their types (bool, int, float, str; `object` for anything else, read as YAML): the
    fields BilinearConfig declares, and Gated DeltaNet's own (`GATED_DELTANET_OPTIONS`).
    `vocab_size` defaults to the tokenizer's length."""
    key_types = {}
    for name, annotation in BilinearConfig.__annotations__.items():
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None -> X
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if len(args) == 1 else object
        key_types[name] = annotation if annotation in (bool, int, float, str) else object
    return {**key_types, **{key: type(default) for key, default in GATED_DELTANET_OPTIONS.items()}}


def model_value(key: str, text: str):
    """`--model.KEY`'s value ``text`` as the field's type."""
    typ = model_key_types()[key]
    try:
        if typ is bool:
            return string_to_bool(text)
        return yaml.safe_load(text) if typ is object else typ(text)
    except (ValueError, ArgumentTypeError):
        raise TrainingInputError(f"argument {MODEL_PREFIX}{key}: invalid {typ.__name__} value: {text!r}") from None


def join_negative_values(args: list[str]) -> list[str]:
    """`--key -1e-3` -> `--key=-1e-3`: argparse takes a negative number in scientific notation for an option (and
    says "expected one argument")."""
    joined = []
    for arg in args:
        if joined and NEGATIVE_NUMBER.fullmatch(arg) and joined[-1].startswith("--") and "=" not in joined[-1]:
            joined[-1] += f"={arg}"
        else:
            joined.append(arg)
    return joined


class _HelpFormatter(ArgumentDefaultsHelpFormatter, RawDescriptionHelpFormatter):
    """Defaults after each argument; the epilog (the model keys) as written."""


class ConfigParser(HfArgumentParser):
    """HfArgumentParser over DataConfig and TrainConfig, plus the `--model.KEY VALUE` overrides. Input errors raise
    TrainingInputError instead of printing the usage and exiting."""

    def __init__(self):
        lines = ["model keys (BilinearConfig fields, the baselines take their depth and size from them; then Gated "
                 "DeltaNet's own):"]
        for key, typ in model_key_types().items():
            default = "len(tokenizer)" if key == "vocab_size" else repr(
                GATED_DELTANET_OPTIONS[key] if key in GATED_DELTANET_OPTIONS else getattr(BilinearConfig, key, None))
            lines.append(f"  {MODEL_PREFIX + key:<32} {'value' if typ is object else typ.__name__:<6} {default}")
        super().__init__([DataConfig, TrainConfig], prog="train.py", allow_abbrev=False, epilog="\n".join(lines),
                         formatter_class=_HelpFormatter,
                         description="Train a bilinear LM (or a baseline) with Accelerate: train.py --config "
                                     "PRESET.yaml [--KEY VALUE ...] [--model.KEY VALUE ...]")

    def error(self, message: str):
        raise TrainingInputError(message)

    def parse(self, args: list[str]) -> Config:
        """``args`` (no preset) -> Config."""
        data, train, rest = self.parse_args_into_dataclasses(join_negative_values(args), return_remaining_strings=True,
                                                             look_for_args_file=False)
        return Config(data, train, self.model_overrides(rest))

    def model_overrides(self, args: list[str]) -> dict:
        """`--model.KEY VALUE`, `--model.KEY=VALUE` or a bare `--model.KEY` (true) -> {KEY: typed value}; any
        other argument is unknown."""
        key_types, overrides, i = model_key_types(), {}, 0
        while i < len(args):
            arg, i = args[i], i + 1
            if not arg.startswith(MODEL_PREFIX):
                known = [s for action in self._actions for s in action.option_strings]
                close = difflib.get_close_matches(arg.split("=")[0], known, n=1, cutoff=0.8)
                raise TrainingInputError(f"unknown argument {arg.split('=')[0]!r}" + (
                    f" (did you mean {close[0]}?)" if close else "") + "; train.py --help lists the arguments")
            key, has_value, value = arg[len(MODEL_PREFIX):].partition("=")
            if key not in key_types:
                raise TrainingInputError(f"unknown model key {key!r}; valid model keys: {sorted(key_types)}")
            if not has_value:
                value, i = (args[i], i + 1) if i < len(args) and not args[i].startswith("--") else ("true", i)
            overrides[key] = model_value(key, value)
        return overrides


def preset_arguments(path: str) -> list[str]:
    """A YAML preset as command-line arguments: `key: value` -> `--key=value`, `model: {key: value}` ->
    `--model.key=value`; null values are left out (the key keeps its default)."""
    if not Path(path).is_file():
        raise TrainingInputError(f"--config {path!r}: preset file not found (presets live in bilinear_lm/configs/)")
    try:
        preset = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise TrainingInputError(f"--config {path!r}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(preset, dict) or not isinstance(preset.get("model") or {}, dict):
        raise TrainingInputError(f"--config {path!r}: a preset maps keys to values, with the model keys under "
                                 f"`model:`")
    model = preset.pop("model", None) or {}
    as_text = lambda value: value if isinstance(value, str) else json.dumps(value)  # noqa: E731 - true, 1e-06, [1, 2]
    return ([f"--{key}={as_text(value)}" for key, value in preset.items() if value is not None]
            + [f"{MODEL_PREFIX}{key}={as_text(value)}" for key, value in model.items() if value is not None])


def parse_config(argv: list[str], environ=None) -> Config:
    """The dataclass defaults <- the preset of `--config` <- the other command-line arguments (`--help` prints them
    all and exits); `--mixed_precision` as `resolve_mixed_precision` says, the launcher's read from ``environ``
    (default os.environ). Raises TrainingInputError for unknown keys and values of the wrong type, naming the key."""
    parser = ConfigParser()
    cfg = command_line = parser.parse(list(argv))
    preset_precision = None
    if cfg.train.config is not None:
        preset = preset_arguments(cfg.train.config)
        try:
            preset_precision = parser.parse(preset).train.mixed_precision
        except TrainingInputError as err:
            raise TrainingInputError(f"preset {cfg.train.config}: {err}") from None
        cfg = parser.parse(preset + list(argv))  # the last value of a key wins: the command line's
    cfg.train.mixed_precision, source = resolve_mixed_precision(
        command_line.train.mixed_precision, os.environ if environ is None else environ, preset_precision)
    return cfg._replace(mixed_precision_from=source, argv=tuple(argv))


def resolve_mixed_precision(command_line: str | None, environ, preset: str | None) -> tuple[str | None, str]:
    """The autocast precision (None: Accelerate's default, no) and where it came from: train.py's --mixed_precision,
    else the launcher's (`accelerate launch --mixed_precision` or its config file, which it passes on as
    ACCELERATE_MIXED_PRECISION), else the preset's. The launcher's `no` does not override a preset: the launcher sets
    `no` whenever neither its flag nor its config file sets a precision, so it cannot tell a choice from its default;
    train.py --mixed_precision no can."""
    launcher = environ.get("ACCELERATE_MIXED_PRECISION") or None
    if command_line is not None:
        return command_line, "train.py --mixed_precision"
    if launcher not in (None, "no"):
        over = f", over the preset's {preset}" if preset not in (None, launcher) else ""
        return launcher, f"the launcher's: accelerate launch --mixed_precision or its config file{over}"
    if preset is not None:
        return preset, "the preset's"
    return None, "the default" if launcher is None else "the launcher's default"


def flat_config(cfg: Config) -> dict:
    """The config as tracker hyperparameters: scalars as they are, `model.KEY` for the model keys."""
    flat = {**asdict(cfg.data), **asdict(cfg.train), **{f"model.{k}": v for k, v in cfg.model.items()}}
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}
