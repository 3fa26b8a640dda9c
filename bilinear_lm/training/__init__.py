"""What train.py is built from: its configuration (dataclasses, YAML presets, the command line), the data pipeline
and its loaders, checkpoints and the TrainState they carry, metrics, and helpers for several processes.

    config        Config, DataConfig, TrainConfig, parse_config, flat_config, TrainingInputError
    data          load_raw_text, build_tokenizer, tokenize_and_pack, DataError, DEFAULT_TRAIN_FILE
    loader        Data, load_data, collate, check_blocks_fit_vocabulary, micro_batches
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
import importlib

# Each name's module, imported on first use: `train.py --help` reads the configuration without loading the data
# pipeline (datasets).
_MODULES = {
    "config": ["Config", "DataConfig", "TrainConfig", "TrainingInputError", "parse_config", "flat_config"],
    "data": ["DEFAULT_TRAIN_FILE", "DataError", "build_tokenizer", "load_raw_text", "tokenize_and_pack"],
    "loader": ["Data", "load_data", "collate", "check_blocks_fit_vocabulary", "micro_batches"],
    "checkpoint": ["TrainState", "find_checkpoint", "latest_checkpoint", "save_checkpoint", "load_data_state",
                   "check_config_change", "verify_checkpoint", "prune_checkpoints", "diverged_message",
                   "disk_full_is_one_line", "DiskFullError"],
    "output_dir": ["own_output_dir"],
    "stopping": ["StopOnSignal", "Stopped"],
    "metrics": ["MetricsLog", "append_metrics", "read_metrics", "plot_losses", "peak_rss_mib", "run_summary"],
    "model_card": ["model_card", "write_model_card"],
    "distributed": ["together", "fail_together", "check_launch", "unsharded_copy", "params_identical_across_ranks",
                    "end_training", "bf16_cpu_warning"],
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
