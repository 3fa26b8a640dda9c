"""Checkpoints you can trust: `accelerator.save_state` plus the `TrainState` and the run's configuration, written
so that a killed run never leaves a checkpoint that looks complete but is not (temporary directory, a manifest of
every file's size and SHA-256, the marker file last, atomic rename), verified against the manifest before use, and
pruned to the newest `--save_total_limit`.

    OUTPUT_DIR/checkpoints/step_N/
        model.safetensors, optimizer.bin, scheduler.bin, random_states_R.pkl   accelerator.save_state
        tokenizer/                 the run's tokenizer (a resumed run loads it from here)
        trainer_state.json         TrainState
        data_state_R.json          with --streaming: rank R's position in the stream (IterableDataset.state_dict())
        training_config.json       Config: data, train, model (compared with the resuming run's: check_config_change)
        manifest.json              {"files": {relative path: {"size": bytes, "sha256": hex}}} of all the above
        CHECKPOINT_COMPLETE        written last

Only JSON is read here; the pickles are read by `accelerator.load_state` with `weights_only=True` (Accelerate's
default: we register no custom objects, whose loading it does with weights_only=False), and only after the manifest
matched. The manifest catches truncation and bit rot, not tampering (whoever can rewrite a file can rewrite it).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from .config import Config, TrainingInputError, model_key_types

DONE_MARKER = "CHECKPOINT_COMPLETE"
MANIFEST = "manifest.json"
CONFIG_FILE = "training_config.json"


@dataclass
class TrainState:
    """Where training stands: saved with every checkpoint (`trainer_state.json`) and restored on resume, so the step
    count, the data order and the training clock continue where they stopped."""

    step: int = 0               # optimizer steps done
    epoch: int = 0              # pass over the training data in progress (0-based)
    batches_done: int = 0       # micro-batches of this epoch consumed
    train_seconds: float = 0.0  # wall-clock spent in training steps (not evaluation or checkpoints), over all resumes

    @classmethod
    def load(cls, checkpoint: Path) -> TrainState:
        saved = json.loads((checkpoint / "trainer_state.json").read_text())
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})  # older ones lack train_seconds


# --------------------------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """`directory`/manifest.json: the size and SHA-256 of every file under it (but the manifest and the marker)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, DONE_MARKER))
    manifest = {"files": {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
                          for p in files}}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None: it is complete and every file matches its manifest).
    A checkpoint written before manifests existed (none, but the marker) passes unverified."""
    if not (path / DONE_MARKER).exists():
        return f"incomplete (no {DONE_MARKER} marker)"
    if not (path / MANIFEST).exists():
        return None  # written before checkpoints had a manifest: nothing to check against
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its {MANIFEST} is unreadable ({type(err).__name__})"
    for name, (size, sha256) in expected.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if _sha256(file) != sha256:
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    return None


def latest_checkpoint(output_dir: str,
                      warn: Callable[[str], None] = print) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest OUTPUT_DIR/checkpoints/step_N that is complete and matches its manifest (None if none does), and
    the newer complete ones skipped as damaged, newest first, each with why. When it finds one, it `warn`s about each
    skipped one."""
    done = [p for p in (Path(output_dir) / "checkpoints").glob("step_*") if (p / DONE_MARKER).exists()]
    damaged = []
    for path in sorted(done, key=_step, reverse=True):
        problem = verify_checkpoint(path)
        if problem is None:
            for bad, why in damaged:
                warn(f"warning: skipping checkpoint {bad}: {why}; trying the previous one")
            return _warn_if_unverified(path, warn), damaged
        damaged.append((path, problem))
    return None, damaged


def find_checkpoint(output_dir: str, spec: str, warn: Callable[[str], None] = print) -> Path | None:
    """`latest` -> the newest OUTPUT_DIR/checkpoints/step_N that is complete and matches its manifest (None if there
    is none), `warn`ing about each newer one skipped and why (`latest_checkpoint`); else the checkpoint at path
    `spec`, which must be complete and valid (else a one-line TrainingInputError)."""
    if spec == "latest":
        return latest_checkpoint(output_dir, warn)[0]
    path = Path(spec)
    if not (path / DONE_MARKER).exists():
        raise TrainingInputError(f"--resume_from_checkpoint {spec!r}: not a complete checkpoint directory "
                                 f"(expected {path / DONE_MARKER}); use 'latest' or OUTPUT_DIR/checkpoints/step_N")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise TrainingInputError(f"--resume_from_checkpoint {spec!r}: the checkpoint is damaged: {problem}; resume "
                                 f"from another one (--resume_from_checkpoint latest skips damaged ones)")
    return _warn_if_unverified(path, warn)


def _warn_if_unverified(path: Path, warn: Callable[[str], None]) -> Path:
    if not (path / MANIFEST).exists():
        warn(f"warning: {path} has no {MANIFEST} (saved before checkpoints had one): using it unverified")
    return path


def _step(path: Path) -> int:
    try:
        return int(path.name.split("_")[1])
    except (IndexError, ValueError):
        return -1


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


# ------------------------------------------------------------------------------------------------ config
# What a resumed run may change, by field of DataConfig and TrainConfig (a test checks that every field is in exactly
# one of the sets, so a new option has to be placed):
#   RESUME_MUST_MATCH      the model: the checkpoint's weights and optimizer state have its shapes. Always an error.
#   RESUME_TOKENIZER       the tokenizer: a resumed run reads the checkpoint's (CHECKPOINT/tokenizer), whose token ids
#                          its embeddings learned; a new one would give them other tokens. Always an error (a
#                          --bpe_vocab_size only when the checkpoint's tokenizer is a trained BPE).
#   RESUME_CHANGE_ALLOWED_WITH_FLAG   the data, its batching and the optimization: the run would not continue the
#                          checkpoint's (another data position, another tokenization, hyperparameters the restored
#                          optimizer and scheduler partly override). An error unless --allow_config_change.
#   RESUME_FREE            how long to train and what to report: max_steps (extends or shortens the cosine schedule),
#                          the logging / evaluation / checkpoint intervals and limits, trackers, the final sample and
#                          lm-eval, DataLoader workers and tokenizing processes, autocast precision (another device may want another), where the
#                          run writes, and the resume and overwrite flags themselves. Never checked.
# The `--model.KEY`s all must match but for MODEL_RUNTIME_KEYS (how the same weights are computed, not what they are).
RESUME_MUST_MATCH = {"model_type"}
RESUME_TOKENIZER = {"tokenizer", "bpe_vocab_size"}
RESUME_CHANGE_ALLOWED_WITH_FLAG = {
    "dataset", "dataset_config", "train_file", "validation_file", "text_column", "val_fraction", "add_eos",
    "block_size", "streaming", "batch_size", "gradient_accumulation_steps", "seed",
    "learning_rate", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip"}
RESUME_FREE = {
    "config", "max_steps", "log_interval", "eval_interval", "eval_iters", "save_interval", "save_total_limit",
    "resume_from_checkpoint", "allow_config_change", "output_dir", "overwrite_output_dir", "report_to",
    "sample_tokens", "sample_prompt", "eval_lm_harness", "lm_harness_limit", "num_workers", "num_proc",
    "mixed_precision"}
MODEL_RUNTIME_KEYS = {"recurrence_impl", "use_cache"}


def config_record(cfg: Config) -> dict:
    """The configuration as saved with a checkpoint (`training_config.json`)."""
    return {"data": asdict(cfg.data), "train": asdict(cfg.train), "model": dict(cfg.model)}


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def check_config_change(checkpoint: Path, cfg: Config, warn: Callable[[str], None] = print) -> None:
    """Compare the resuming run's configuration with the one saved in `checkpoint`: a changed model or tokenizer
    option is a one-line TrainingInputError naming each option and both values; a changed data / batching /
    optimization option is one too unless --allow_config_change (then a warning). Checkpoints from before the config was saved pass with
    a warning."""
    if not (checkpoint / CONFIG_FILE).exists():
        warn(f"warning: {checkpoint} has no {CONFIG_FILE} (saved before checkpoints recorded their configuration): "
             f"cannot check that this run's options match it")
        return
    saved = json.loads((checkpoint / CONFIG_FILE).read_text())  # verified against the manifest already
    now = config_record(cfg)
    old_flat = {**saved.get("data", {}), **saved.get("train", {})}
    new_flat = {**now["data"], **now["train"]}
    missing = object()

    def changes(keys):
        return [f"--{k} {_show(old_flat[k])} -> {_show(new_flat[k])}" for k in sorted(keys)
                if k in old_flat and old_flat[k] != new_flat.get(k, missing)]

    from bilinear_lm import BilinearConfig

    def model_default(key):
        return None if key == "vocab_size" else getattr(BilinearConfig, key, None)

    old_model, new_model = saved.get("model", {}), now["model"]
    model_changes = changes(RESUME_MUST_MATCH) + [
        f"--model.{k} {_show(old_model.get(k, model_default(k)))} -> {_show(new_model.get(k, model_default(k)))}"
        for k in sorted((set(old_model) | set(new_model)) & set(model_key_types()) - MODEL_RUNTIME_KEYS)
        if old_model.get(k, model_default(k)) != new_model.get(k, model_default(k))]
    if model_changes:
        raise TrainingInputError(f"--resume_from_checkpoint {checkpoint}: the model differs from the checkpoint's "
                                 f"({', '.join(model_changes)}): resume with the checkpoint's values or start a new "
                                 f"--output_dir")
    trained_bpe = old_flat.get("tokenizer") in (None, "", "bpe")
    tokenizer_changes = changes(RESUME_TOKENIZER if trained_bpe else RESUME_TOKENIZER - {"bpe_vocab_size"})
    if tokenizer_changes:
        raise TrainingInputError(f"--resume_from_checkpoint {checkpoint}: the tokenizer is the checkpoint's "
                                 f"({', '.join(tokenizer_changes)}): a resumed run keeps {checkpoint / 'tokenizer'}, "
                                 f"whose token ids the model learned, even with --allow_config_change; resume with "
                                 f"the checkpoint's values, or start a new --output_dir for another tokenizer")
    other_changes = changes(RESUME_CHANGE_ALLOWED_WITH_FLAG)
    if other_changes and not cfg.train.allow_config_change:
        raise TrainingInputError(f"--resume_from_checkpoint {checkpoint}: the data or optimization differs from the "
                                 f"checkpoint's ({', '.join(other_changes)}): resume with the checkpoint's values, or "
                                 f"pass --allow_config_change to continue with the new ones (the run will not "
                                 f"reproduce an uninterrupted one)")
    if other_changes:
        warn(f"warning: resuming {checkpoint} with changed options ({', '.join(other_changes)}; "
             f"--allow_config_change): the run will not reproduce an uninterrupted one")


def load_data_state(checkpoint: Path, rank: int) -> dict:
    """Rank `rank`'s position in the streamed training data, saved with `checkpoint`."""
    path = checkpoint / f"data_state_{rank}.json"
    if not path.is_file():
        raise TrainingInputError(f"--resume_from_checkpoint {checkpoint}: no {path.name} (the run that saved it did "
                                 f"not use --streaming, or had fewer processes): resume with that run's options")
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------- save
class DiskFullError(OSError):
    """A save that ran out of disk space. The message is one line: the folder, about how much the save needs and
    how much is free, and the command that resumes from the last complete checkpoint."""


def _size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mb(size: int) -> str:
    return f"{size / 2 ** 20:.{1 if size < 10 * 2 ** 20 else 0}f} MB"


def _out_of_space(error: BaseException, folder: Path) -> bool:
    """ENOSPC anywhere in ``error``'s chain, or any other error of a writer (torch's says only "unexpected pos")
    while ``folder``'s disk has less than 1 MiB free."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    try:
        return shutil.disk_usage(folder).free < 2 ** 20
    except OSError:
        return False


@contextmanager
def disk_full_is_one_line(output_dir: str, what: str, partial: Path | None = None):
    """Run a save; if it runs out of disk space, delete ``partial`` (what it had written: a checkpoint's temporary
    folder) and raise :class:`DiskFullError` naming ``output_dir``, the space ``what`` needs (the last complete
    checkpoint's size, else what was written), the space free, and how to resume (the last complete checkpoint stays
    the resume point). Any other error passes unchanged."""
    try:
        yield
    except Exception as error:
        if not _out_of_space(error, Path(output_dir)):
            raise
        written = _size(partial)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        last = latest_checkpoint(output_dir, warn=lambda _: None)[0]
        need = f"about {_mb(_size(last))}" if last is not None else f"over {_mb(written)}"
        free = _mb(shutil.disk_usage(output_dir).free)
        then = (f"run the same command with --resume_from_checkpoint latest (it continues from {last})" if last
                else "run the same command again (no checkpoint was complete: it starts over)")
        raise DiskFullError(f"no space left in {output_dir} to save {what}: a checkpoint takes {need}, {free} are "
                            f"free there; free some space, then {then}") from None


def save_checkpoint(accelerator, output_dir: str, state: TrainState, tokenizer, cfg: Config | None = None,
                    total_limit: int = 0, data_state: dict | None = None) -> Path:
    """accelerator.save_state into a temporary directory, the tokenizer, TrainState and config next to it (and each
    rank's `data_state`, its position in a streamed dataset), the manifest, the marker written last, then an atomic
    rename to OUTPUT_DIR/checkpoints/step_N; then keep only the newest `total_limit` complete checkpoints (0: all).
    Every process calls it; returns OUTPUT_DIR/checkpoints/step_N. Out of disk space: DiskFullError, the temporary
    directory deleted (`disk_full_is_one_line`)."""
    final = Path(output_dir) / "checkpoints" / f"step_{state.step}"
    tmp = final.with_name(f".tmp_step_{state.step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    with disk_full_is_one_line(output_dir, f"checkpoint step_{state.step}", tmp):
        hook = accelerator.register_save_state_pre_hook(drop_tied_copies)
        try:
            accelerator.save_state(str(tmp))  # model, optimizer, scheduler, RNG states of every rank
        finally:
            hook.remove()
        if data_state is not None:
            (tmp / f"data_state_{accelerator.process_index}.json").write_text(json.dumps(data_state))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            tokenizer.save_pretrained(tmp / "tokenizer")
            (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
            if cfg is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(config_record(cfg), indent=1))
            write_manifest(tmp)
            with open(tmp / DONE_MARKER, "w") as f:
                f.write(f"{state.step}\n")
                f.flush()
                os.fsync(f.fileno())
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if total_limit:
            prune_checkpoints(output_dir, total_limit, keep=final)
    accelerator.wait_for_everyone()
    return final


def drop_tied_copies(models, weights, _output_dir) -> None:
    """An `accelerator.save_state` pre-hook: leave each model's tied copies out of the state dict it saves, as
    transformers' save_pretrained does (the weights a model declares tied, `all_tied_weights_keys`: e.g. the LM head
    of tied embeddings). Accelerate's saver otherwise drops them itself, with a warning at every checkpoint ("Removed
    shared tensor {'lm_head.weight'} ... check that you don't receive any warning while reloading"): it cannot tell a
    declared tie from an accidental alias. Its loader (safetensors' `load_model`) accepts the missing alias of a
    tensor it loads, and the model stays tied. `weights` holds the state dicts of the models Accelerate saves as
    state dicts (none under FSDP or DeepSpeed, which save their own way)."""
    from accelerate.utils import extract_model_from_parallel

    for model, state_dict in zip(models, weights):
        tied = getattr(extract_model_from_parallel(model), "all_tied_weights_keys", None) or {}
        for name in list(state_dict):
            prefix = next((name[:-len(t)] for t in tied if name == t or name.endswith("." + t)), None)
            source = None if prefix is None else state_dict.get(prefix + tied[name[len(prefix):]])
            if source is not None and source.data_ptr() == state_dict[name].data_ptr():  # still one tensor
                del state_dict[name]


def prune_checkpoints(output_dir: str, total_limit: int, keep: Path) -> list[Path]:
    """Delete the complete OUTPUT_DIR/checkpoints/step_N but the newest `total_limit` by step, and never `keep`, the
    one just written (older than some when the run resumed from an older checkpoint: both stay, and the newer ones
    are replaced as the run saves at their steps); partial ones (.tmp_step_N, no marker) are not touched. Returns the
    deleted ones.

    Not Accelerate's ProjectConfiguration(total_limit=...): it works only with its automatic checkpoint_N naming
    inside save_state, which counts every directory (partial ones included) and would delete before our save is
    complete."""
    done = sorted((p for p in (Path(output_dir) / "checkpoints").glob("step_*") if (p / DONE_MARKER).exists()),
                  key=_step, reverse=True)
    doomed = [p for p in done[total_limit:] if p.resolve() != keep.resolve()]
    for path in doomed:
        (path / DONE_MARKER).unlink()  # first: a deletion cut short leaves a partial checkpoint, not a broken one
        shutil.rmtree(path)
    return doomed
