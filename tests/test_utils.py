"""bilinear_lm.utils.keep_freed_memory: a large freed block is reused instead of mapped and faulted in again."""
import platform
import subprocess
import sys

import pytest

# In a process of its own (the setting is process-wide), before and after the call: allocate and free a 64 MiB
# tensor (above glibc's 32 MiB ceiling for mmap), then count the page faults of allocating and filling a 48 MiB one.
CHILD = """
import resource, torch
from bilinear_lm.utils import keep_freed_memory
def faults_of_next_block():
    torch.ones(2**24)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(3 * 2**22)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults_of_next_block(), keep_freed_memory(), faults_of_next_block())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_keep_freed_memory_reuses_large_blocks():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    default, applied, kept = out.split()
    pages = 3 * 2**24 // 4096
    assert int(default) >= 0.95 * pages  # glibc's default: a fresh mapping, every page faulted in
    assert applied == "True" and int(kept) < 0.05 * pages  # the freed block's pages, already there
