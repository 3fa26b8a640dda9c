"""Distributed launches on CPU: a launch that asks for N processes but runs N single-process trainings is refused;
FSDP2 (`fully_shard`) over 2 gloo ranks matches one unsharded process (tests/fsdp_worker.py); the unsharded copy
finish() samples and evaluates under FSDP. The two launches start together at module start."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bilinear_lm.training import DEFAULT_TRAIN_FILE, TrainingInputError, check_launch, unsharded_copy

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}, "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def launches(tmp_path_factory):
    """The module's two launches, started side by side at module start (their tests wait for them): MULTI_GPU,
    `accelerate launch --multi_gpu --num_processes 2` of train.py without ACCELERATE_USE_CPU=1 (into OUT); FSDP,
    torchrun of tests/fsdp_worker.py on 2 ranks (into FSDP_DIR)."""
    root = tmp_path_factory.mktemp("launches")
    text = root / "text.txt"
    text.write_text(Path(DEFAULT_TRAIN_FILE).read_text()[:5_000])
    out, fsdp_dir = root / "out", root / "fsdp"
    fsdp_dir.mkdir()
    multi_gpu = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_port", str(_free_port()), "train.py", "--config",
                 str(REPO / "bilinear_lm" / "configs" / "shakespeare-char.yaml"), "--train_file", str(text),
                 "--output_dir", str(out), "--max_steps", "2", "--block_size", "16", "--batch_size", "2",
                 "--save_interval", "1", "--sample_tokens", "0", "--model.hidden_size", "16",
                 "--model.num_hidden_layers", "1", "--model.num_heads", "2", "--model.state_size", "4",
                 "--model.rank", "4"]
    fsdp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port()), str(REPO / "tests" / "fsdp_worker.py"), str(fsdp_dir)]
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in (("multi_gpu", multi_gpu), ("fsdp", fsdp))}
    yield SimpleNamespace(out=out, fsdp_dir=fsdp_dir, **procs)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_multi_gpu_launch_without_gpus_is_refused_on_every_process(launches):
    """`accelerate launch --multi_gpu --num_processes 2` without ACCELERATE_USE_CPU=1 and without GPUs: torchrun
    starts 2 processes (WORLD_SIZE=2) whose Accelerators each run alone. They must stop before writing anything."""
    output = "".join(launches.multi_gpu.communicate(timeout=120))
    assert launches.multi_gpu.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, output[-3000:]  # one line from each process
    assert all("the launcher started 2 processes (WORLD_SIZE=2) but each runs as a single process" in line
               and "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train.py" in line
               and "FSDP through Accelerate needs GPUs" in line for line in errors), errors
    assert not launches.out.exists()  # no tokenizer, checkpoint or model


def test_check_launch_names_fsdp_and_passes_real_launches():
    one = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    with pytest.raises(TrainingInputError, match=r"started 4 processes .* no GPU for FSDP\).*--num_processes 4"):
        check_launch(one, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true"})
    check_launch(one, {})  # python train.py
    check_launch(one, {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})  # accelerate launch, one process
    check_launch(SimpleNamespace(num_processes=2, device=torch.device("cpu")), {"WORLD_SIZE": "2"})  # CPU DDP


def test_fsdp2_fully_shard_over_2_gloo_ranks_matches_one_unsharded_process(launches):
    """tests/fsdp_worker.py on 2 CPU ranks: loss, gathered gradients and parameters after a step, and the saved
    gathered state dict reloaded with from_pretrained (identical logits) against one process's unsharded model."""
    output = "".join(launches.fsdp.communicate(timeout=240))
    assert launches.fsdp.returncode == 0, output[-4000:]
    assert (launches.fsdp_dir / "rank0.json").exists() and (launches.fsdp_dir / "rank1.json").exists()
    assert (launches.fsdp_dir / "model" / "model.safetensors").exists()


def test_unsharded_copy_of_a_state_dict_gives_identical_logits(tiny_bilinear_config):
    from bilinear_lm import BilinearForCausalLM

    torch.manual_seed(0)
    model = BilinearForCausalLM(tiny_bilinear_config).eval()
    model.generation_config.max_new_tokens = 7
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = unsharded_copy(model, {k: v.clone() for k, v in model.state_dict().items()})
    assert type(plain) is BilinearForCausalLM and plain is not model and not plain.training
    assert plain.generation_config.max_new_tokens == 7
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # tied, as in the original
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("sharded", [True, False])
def test_finish_samples_and_evaluates_an_unsharded_copy_only_under_fsdp(tiny_bilinear_config, tmp_path, monkeypatch,
                                                                       sharded):
    """train.finish() with a stand-in accelerator: under FSDP the main process's sample and lm-eval get a plain copy
    built from the gathered state dict (same logits), otherwise the model itself, as before."""
    from accelerate.utils import DistributedType

    import train
    from bilinear_lm import BilinearForCausalLM
    from bilinear_lm.training import MetricsLog, TrainState, parse_config

    torch.manual_seed(0)
    model = BilinearForCausalLM(tiny_bilinear_config)
    accelerator = SimpleNamespace(
        distributed_type=DistributedType.FSDP if sharded else DistributedType.NO, num_processes=1,
        is_main_process=True, device=torch.device("cpu"), unwrap_model=lambda m: m, wait_for_everyone=lambda: None,
        get_state_dict=lambda m: {k: v.clone() for k, v in m.state_dict().items()},
        gather=lambda t: t)
    cfg = parse_config(["--output_dir", str(tmp_path), "--sample_tokens", "3", "--eval_lm_harness", "lambada"])
    used = {}
    monkeypatch.setattr(train, "print_sample", lambda cfg, m, *a: used.setdefault("sample", m))
    monkeypatch.setattr(train, "run_harness", lambda m, *a: used.setdefault("harness", m))
    monkeypatch.setattr(train, "plot_losses", lambda *a: None)
    data = SimpleNamespace(tokenizer=SimpleNamespace(save_pretrained=lambda d: None), raw=None)
    train.finish(cfg, accelerator, model, data, TrainState(), MetricsLog(accelerator, tmp_path / "metrics.jsonl"), 1)
    assert used["sample"] is used["harness"]
    assert (used["sample"] is not model) == sharded
    ids = torch.randint(0, tiny_bilinear_config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(used["sample"].eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert (tmp_path / "model.safetensors").exists()
