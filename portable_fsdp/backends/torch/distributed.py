"""Process-group set-up for one worker: gloo on CPU, NCCL on CUDA, with a bounded collective timeout."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist

from portable_fsdp.machine import host_cores
from portable_fsdp.errors import UserError


# The single-tensor collectives under the names this torch has: newer releases renamed them and warn at every call of
# the old names (all_gather_into_tensor, reduce_scatter_tensor).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class Runtime:
    backend: str  # "cpu" | "cuda"
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def initialize(backend: str, timeout_s: int) -> Runtime:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # The CPU work of a rank (the cpu backend's step; an offloaded AdamW beside a GPU) on its share of the cores
    torch.set_num_threads(host_cores.share(local_world))
    if backend == "cuda":
        device = torch.device("cuda", device_index(local_rank, local_world, torch.cuda.device_count()))
        use_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        with gloo_banner_hidden():
            dist.init_process_group(backend="nccl" if backend == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if backend == "cuda" else None)
    return Runtime(backend, rank, world_size, local_rank, device)


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (a thread starts on GPU 0); nothing for other devices."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_index(local_rank: int, local_ranks: int, visible: int) -> int:
    """The CUDA device of local rank `local_rank` of `local_ranks` on a host where each process sees `visible`
    GPUs: its own index when every rank sees them all, 0 when each process is shown one GPU of its own (SLURM's
    --gpus-per-task, a Kubernetes pod per GPU: CUDA_VISIBLE_DEVICES names another GPU per process, and
    LOCAL_RANK is no device index there)."""
    if visible == 0:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise UserError("--backend", f"cuda: local rank {local_rank} sees no GPU (CUDA_VISIBLE_DEVICES={shown}); "
                        "give every rank a GPU or use --backend cpu")
    if local_rank < visible and visible >= local_ranks:
        return local_rank
    if visible == 1:
        return 0
    raise UserError("--backend", (
        f"cuda: {local_ranks} local ranks and {visible} GPUs visible to local rank {local_rank}; show every rank "
        "all of this host's GPUs (one per rank) or exactly one of its own (CUDA_VISIBLE_DEVICES)"))


@contextlib.contextmanager
def gloo_banner_hidden():
    """Around creating process groups: gloo prints "[Gloo] Rank r is connected to n peer ranks..." to stdout
    (std::cout, with no setting to turn it off) once per rank and group. Standard output is pointed at
    /dev/null meanwhile; stderr, where torch's warnings and errors go, is left alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


_SLOW_GROUPS: dict = {}


def slow_group(timeout_s: float):
    """A gloo group of every rank whose collectives wait up to `timeout_s` rather than train.collective_timeout_s
    (the waits around a save or a verification, which grow with the bytes). Made the first time a bound is asked
    for, by every rank at once (creating a group is a collective); the same bound reuses it."""
    seconds = int(math.ceil(timeout_s))
    if seconds not in _SLOW_GROUPS:
        with gloo_banner_hidden():
            _SLOW_GROUPS[seconds] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    return _SLOW_GROUPS[seconds]


def shutdown() -> None:
    _SLOW_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
