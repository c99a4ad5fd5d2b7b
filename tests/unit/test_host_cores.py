"""Each local rank's share of the cores this process may use (its affinity, a container's CPU quota), and which
CUDA device a rank takes. The CUDA decision is tested with the visible GPU count injected (no GPU here)."""
import os

import pytest

from portable_fsdp.machine import host_cores
from portable_fsdp.backends.torch.distributed import device_index
from portable_fsdp.errors import UserError


def test_a_rank_takes_its_share_of_the_cores_never_none():
    assert host_cores.share(8, cores=64) == 8
    assert host_cores.share(3, cores=16) == 5
    assert host_cores.share(8, cores=4) == 1
    assert host_cores.share(0, cores=4) == 4


@pytest.mark.parametrize("text, cores", [("max 100000", None), ("150000 100000", 2), ("400000 100000", 4),
                                         ("50000 100000", 1), ("garbage", None)])
def test_a_containers_cpu_quota_caps_the_cores(tmp_path, text, cores):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n")
    affinity = len(os.sched_getaffinity(0))
    assert host_cores.available(cpu_max) == (min(affinity, cores) if cores else affinity)


def test_no_cgroup_file_means_the_affinity_set():
    assert host_cores.available(host_cores.CGROUP_CPU_MAX.parent / "no-such-file") == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("local_rank, local_ranks, visible, index", [
    (3, 8, 8, 3),  # every rank sees the node's 8 GPUs
    (1, 2, 8, 1),  # fewer ranks than GPUs
    (5, 8, 1, 0),  # one GPU per process (SLURM --gpus-per-task=1, a pod per GPU): device 0, whatever LOCAL_RANK
    (0, 1, 1, 0),
])
def test_the_cuda_device_of_a_rank(local_rank, local_ranks, visible, index):
    assert device_index(local_rank, local_ranks, visible) == index


def test_a_rank_without_a_gpu_or_with_a_share_that_does_not_map_is_one_line():
    with pytest.raises(UserError, match="local rank 2 sees no GPU"):
        device_index(2, 4, 0)
    with pytest.raises(UserError, match="4 local ranks and 2 GPUs visible to local rank 3"):
        device_index(3, 4, 2)
