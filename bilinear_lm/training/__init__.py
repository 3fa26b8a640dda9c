"""What train.py is built from: its configuration (dataclasses, YAML presets, the command line), the data pipeline
and its loaders, checkpoints and the TrainState they carry, metrics, and helpers for several processes.

    config        Config, DataConfig, TrainConfig, parse_config, flat_config, TrainingInputError
    data          load_raw_text, build_tokenizer, tokenize_and_pack, DataError, DEFAULT_TRAIN_FILE
    loader        Data, load_data, collate, check_token_ids, micro_batches
    checkpoint    TrainState, find_checkpoint, latest_checkpoint, save_checkpoint, load_data_state,
                  check_config_change, verify_checkpoint, prune_checkpoints, diverged_message,
                  disk_full_is_one_line, DiskFullError
    output_dir    own_output_dir (the lock on --output_dir, the checkpoint to resume, another run's results refused)
    stopping      StopOnSignal, Stopped (SIGTERM / SIGINT: a checkpoint at the next step, then exit 128 + signal)
    metrics       MetricsLog, append_metrics, read_metrics, plot_losses, peak_rss_mib, run_summary
    model_card    model_card, write_model_card (OUTPUT_DIR/README.md)
    distributed   together, fail_together, check_launch, unsharded_copy, params_identical_across_ranks,
                  end_training, bf16_cpu_warning
"""
from .checkpoint import (DiskFullError, TrainState, check_config_change, disk_full_is_one_line, diverged_message,
                         find_checkpoint, latest_checkpoint, load_data_state, prune_checkpoints, save_checkpoint,
                         verify_checkpoint)
from .config import Config, DataConfig, TrainConfig, TrainingInputError, flat_config, parse_config
from .data import DEFAULT_TRAIN_FILE, DataError, build_tokenizer, load_raw_text, tokenize_and_pack
from .distributed import (bf16_cpu_warning, check_launch, end_training, fail_together, params_identical_across_ranks,
                          together, unsharded_copy)
from .loader import Data, check_token_ids, collate, load_data, micro_batches
from .metrics import MetricsLog, append_metrics, peak_rss_mib, plot_losses, read_metrics, run_summary
from .model_card import model_card, write_model_card
from .output_dir import own_output_dir
from .stopping import StopOnSignal, Stopped

__all__ = ["Config", "DataConfig", "TrainConfig", "TrainingInputError", "parse_config", "flat_config",
           "DEFAULT_TRAIN_FILE", "DataError", "build_tokenizer", "load_raw_text", "tokenize_and_pack", "Data",
           "load_data", "collate", "check_token_ids", "micro_batches", "TrainState", "find_checkpoint",
           "latest_checkpoint", "save_checkpoint", "load_data_state", "check_config_change", "verify_checkpoint",
           "prune_checkpoints", "diverged_message", "disk_full_is_one_line", "DiskFullError", "MetricsLog", "append_metrics", "plot_losses", "read_metrics",
           "peak_rss_mib", "run_summary", "model_card", "write_model_card", "together", "fail_together",
           "params_identical_across_ranks", "end_training", "bf16_cpu_warning", "check_launch", "unsharded_copy",
           "own_output_dir", "StopOnSignal", "Stopped"]
