"""Helpers for running on several processes (and on CPUs): every rank fails together instead of leaving the others
waiting in a collective; identical parameters across ranks; the end of a run (the model freed before the process
group); the bf16-on-CPU warning."""
from __future__ import annotations

import gc
import os
from pathlib import Path

from .config import TrainingInputError


def fail_together(accelerator, error: BaseException | None, what: str) -> None:
    """Called by every rank after a section that can fail on some ranks only: if it failed anywhere, every rank
    raises (a failed rank its own error) instead of leaving the others waiting in the next collective forever.
    One gather of a flag; nothing to exchange in a single process."""
    failed = [0] if error is not None else []
    if accelerator.num_processes > 1:
        import torch

        flags = accelerator.gather(torch.tensor([int(error is not None)], device=accelerator.device))
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if error is not None:
        raise error
    if failed:
        raise TrainingInputError(f"{what} failed on process {', '.join(map(str, failed))} (its error is printed "
                                 f"above); stopping process {accelerator.process_index} too")


def together(accelerator, fn, what: str, main_first: bool = False):
    """``fn()`` on every rank (the main process first, the others after it succeeded, with ``main_first``: e.g. it
    writes files the others read). If it raises on any rank, it raises on every rank (`fail_together`)."""
    result, error = None, None
    if main_first:  # every rank takes part in both exchanges: collectives must match across ranks
        if accelerator.is_main_process:
            try:
                result = fn()
            except Exception as err:  # noqa: BLE001 - re-raised by fail_together on this rank
                error = err
        fail_together(accelerator, error, what)
    if not (main_first and accelerator.is_main_process):
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised by fail_together on this rank
            error = err
    fail_together(accelerator, error, what)
    return result


def check_launch(accelerator, environ=os.environ) -> None:
    """Refuse a launch that started N processes that each run alone: `accelerate launch --multi_gpu` (or the shipped
    multi_gpu.yaml / fsdp.yaml) on a machine without GPUs starts N processes (torchrun's WORLD_SIZE = N) whose
    Accelerator falls back to one process each; they would train independently into the same output directory and
    race on its checkpoints. Every such process raises (they share no process group to fail together through)."""
    launched = max(int(environ.get(key, "1") or 1) for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if launched <= 1 or accelerator.num_processes > 1:
        return
    fsdp = str(environ.get("ACCELERATE_USE_FSDP", "")).lower() in ("1", "true", "yes")
    raise TrainingInputError(
        f"the launcher started {launched} processes (WORLD_SIZE={environ.get('WORLD_SIZE')}) but each runs as a single "
        f"process ({accelerator.device.type}, no GPU for {'FSDP' if fsdp else '--multi_gpu'}): they would train "
        f"separately into the same output directory. On CPU launch ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
        f"--num_processes {launched} train.py ...; FSDP through Accelerate needs GPUs")


def unsharded_copy(model, state_dict):
    """A plain (unsharded) copy of `model` holding `state_dict` (a full state dict, e.g. gathered from FSDP shards by
    `accelerator.get_state_dict`), for what one process does alone at the end (the sample, lm-eval): a sharded
    forward needs every rank. FSDP2's `fully_shard` turns the model's class into FSDP<class>; the copy is of the
    class under it."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    import torch

    copy = cls(model.config)
    copy.load_state_dict({k: v.to(torch.device("cpu")) for k, v in state_dict.items()})  # copies into tied weights too
    copy.generation_config = model.generation_config
    return copy.eval()


def params_identical_across_ranks(accelerator, model) -> bool | None:
    """DDP sanity check: every rank holds identical parameters (None under FSDP: they are sharded)."""
    import torch
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return None
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).reshape(1, -1)
    all_checksums = accelerator.gather(checksum)
    return bool((all_checksums == all_checksums[0]).all().item())


def end_training(accelerator) -> None:
    """Free the prepared model, then destroy the process group. Order matters under DDP over gloo: the model's
    Reducer holds the group, and if it is freed last the group's destructor joins gloo's worker thread while holding
    the GIL, which that thread may need to drop a finished collective's tensors: a deadlock at exit, 1 launch in 5
    (pytorch/pytorch#56297; docs/results-history.md). Freed first, the group's last reference is the Python one,
    whose destructor releases the GIL."""
    accelerator.free_memory()  # drops the accelerator's references to the model, optimizer, scheduler, loaders
    gc.collect()  # free_memory collects before it drops them; a DDP model is in reference cycles
    accelerator.end_training()


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, ARM BF16), from the kernel's CPU flags.
    Without flags to read: False when oneDNN has no bf16 path at all (`torch.ops.mkldnn._is_mkldnn_bf16_supported`),
    else None (unknown). oneDNN's check alone cannot say: it is True on any AVX512 CPU, where bf16 is emulated."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    flags = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    if flags:
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    import torch

    try:
        supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return None
    return False if not supported else None


def bf16_cpu_warning(mixed_precision: str | None, device_type: str) -> str | None:
    """The startup warning for bf16 autocast on a CPU without native bf16 (None when there is nothing to say)."""
    if mixed_precision != "bf16" or device_type != "cpu" or cpu_has_native_bf16() is not False:
        return None
    return ("WARNING: --mixed_precision bf16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16 CPU flag): bf16 "
            "is emulated there and training runs about 14x slower than in fp32 (measured on a 2-core AVX2 CPU). "
            "Use --mixed_precision no on this machine.")
