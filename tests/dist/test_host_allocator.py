"""The cpu step's host memory: a block freed by one step is reused by the next, not faulted in again."""
import os
import platform
import subprocess
import sys

import pytest

from portable_fsdp.backends.torch import host_allocator

# Page faults of a step-like pattern (tensors of 8 to 128 MiB allocated, filled, freed), once the steps before it
# have run.
REFAULTS = """
import resource, sys, torch
from portable_fsdp.backends.torch import host_allocator
applied = host_allocator.keep_freed_blocks() if sys.argv[1] == "keep" else False
def step():
    kept = [torch.empty(n).fill_(1.0) for n in (2**25, 2**23, 2**25, 2**21, 2**24, 2**22, 2**25)]
    del kept
for _ in range(4):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = (3 * 2**25 + 2**24 + 2**23 + 2**22 + 2**21) * 4 // 4096
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def _refaults(mode: str, **env) -> tuple:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-c", REFAULTS, mode], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, check=True)
    applied, faults = proc.stdout.split()
    return applied == "True", int(faults)


@glibc_only
def test_a_freed_block_is_reused_not_faulted_in_again():
    applied, faults = _refaults("keep")
    assert applied and faults < PAGES // 10
    _, default_faults = _refaults("default")  # glibc's default unmaps it: every page faults again
    assert default_faults > PAGES * 0.9


@glibc_only
def test_an_allocator_the_user_set_up_is_left_alone():
    applied, faults = _refaults("keep", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1048576")
    assert not applied and faults > PAGES * 0.9


@pytest.mark.parametrize("environ, chosen", [
    ({}, False),
    ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
    ({"MALLOC_ARENA_MAX_": "2"}, True),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, True),
    ({"LD_PRELOAD": "/opt/lib/libfaketime.so"}, False),
])
def test_what_counts_as_an_allocator_the_user_chose(environ, chosen):
    assert host_allocator._allocator_chosen_by_user(environ) is chosen
