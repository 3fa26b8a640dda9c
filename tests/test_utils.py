"""keep_freed_memory (bilinear_lm.utils, bilinear_lm.modeling.cpu_allocator): a large freed block is reused instead of
mapped and faulted in again, after the call and after the model's first training forward on CPU (which applies it,
says so once, and not with BILINEAR_LM_KEEP_FREED_MEMORY=0); cpu_name, the label of every timing."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

# In a process of its own (the setting is process-wide), before and after: allocate and free a 64 MiB tensor (above
# glibc's 32 MiB ceiling for mmap), then count the page faults of allocating and filling a 48 MiB one.
FAULTS = """
import resource, torch
def faults_of_next_block():
    torch.ones(2**24)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(3 * 2**22)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""
CALL = FAULTS + """
from bilinear_lm.utils import keep_freed_memory
print(faults_of_next_block(), keep_freed_memory(), faults_of_next_block())
"""
TRAIN = FAULTS + """
from bilinear_lm import BilinearConfig, BilinearForCausalLM
model = BilinearForCausalLM(BilinearConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_heads=2,
                                           state_size=8, rank=8, intermediate_size=16, recurrence_impl="torch"))
ids = torch.randint(0, 32, (2, 12))
before = faults_of_next_block()
with torch.no_grad():
    model(ids)  # inference: malloc left alone
after_inference = faults_of_next_block()
model.train()
for _ in range(2):
    model(ids, labels=ids).loss.backward()
print(before, after_inference, faults_of_next_block())
"""
PAGES = 3 * 2**24 // 4096
GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def child(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env})


@GLIBC
def test_keep_freed_memory_reuses_large_blocks():
    default, applied, kept = child(CALL).stdout.split()
    assert int(default) >= 0.95 * PAGES  # glibc's default: a fresh mapping, every page faulted in
    assert applied == "True" and int(kept) < 0.05 * PAGES  # the freed block's pages, already there


@GLIBC
def test_the_models_first_training_forward_on_cpu_keeps_freed_memory_and_says_so_once():
    out = child(TRAIN)
    before, after_inference, after_training = map(int, out.stdout.split())
    assert before >= 0.95 * PAGES and after_inference >= 0.95 * PAGES
    assert after_training < 0.05 * PAGES
    assert out.stderr.count("glibc's malloc now keeps freed memory") == 1, out.stderr
    assert "BILINEAR_LM_KEEP_FREED_MEMORY=0" in out.stderr


@GLIBC
def test_the_opt_out_leaves_malloc_as_it_is():
    out = child(TRAIN, BILINEAR_LM_KEEP_FREED_MEMORY="0")
    assert all(int(faults) >= 0.95 * PAGES for faults in out.stdout.split())
    assert "malloc" not in out.stderr, out.stderr


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="compared with lscpu")
def test_cpu_name_names_the_model_its_family_and_the_simd_level_torch_dispatches_to():
    """What a timing is labelled with, against lscpu's own fields (x86: model name, family, model)."""
    import torch

    from bilinear_lm.utils import cpu_name

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    if not {"Model name", "CPU family", "Model"} <= set(fields):
        pytest.skip("lscpu names no model, family and model here")
    assert cpu_name() == (f"{fields['Model name']} (family {fields['CPU family']} model {fields['Model']}), "
                          f"{torch.backends.cpu.get_cpu_capability()}")
