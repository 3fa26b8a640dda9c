"""What train.py is built from: its configuration (dataclasses, YAML presets, the command line), the data pipeline,
checkpoints and the TrainState they carry, metrics, and helpers for several processes.

    config        Config, DataConfig, TrainConfig, parse_config, TrainingInputError
    data          load_raw_text, build_tokenizer, tokenize_and_pack, DataError, DEFAULT_TRAIN_FILE
    checkpoint    TrainState, find_checkpoint, save_checkpoint, load_data_state, check_config_change,
                  verify_checkpoint, prune_checkpoints
    metrics       MetricsLog, append_metrics, read_metrics, plot_losses
    distributed   together, fail_together, check_launch, unsharded_copy, params_identical_across_ranks,
                  bf16_cpu_warning
"""
from .checkpoint import (TrainState, check_config_change, find_checkpoint, load_data_state, prune_checkpoints,
                         save_checkpoint, verify_checkpoint)
from .config import Config, DataConfig, TrainConfig, TrainingInputError, parse_config
from .data import DEFAULT_TRAIN_FILE, DataError, build_tokenizer, load_raw_text, tokenize_and_pack
from .distributed import (bf16_cpu_warning, check_launch, fail_together, params_identical_across_ranks, together,
                          unsharded_copy)
from .metrics import MetricsLog, append_metrics, plot_losses, read_metrics

__all__ = ["Config", "DataConfig", "TrainConfig", "TrainingInputError", "parse_config", "DEFAULT_TRAIN_FILE",
           "DataError", "build_tokenizer", "load_raw_text", "tokenize_and_pack", "TrainState", "find_checkpoint",
           "save_checkpoint", "load_data_state", "check_config_change", "verify_checkpoint",
           "prune_checkpoints", "MetricsLog", "append_metrics", "plot_losses", "read_metrics", "together",
           "fail_together", "params_identical_across_ranks", "bf16_cpu_warning", "check_launch", "unsharded_copy"]
