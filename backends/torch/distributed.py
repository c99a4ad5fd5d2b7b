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
    if backend == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # Share the cores between the local workers instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        device = torch.device("cpu")
    if not dist.is_initialized():
        with gloo_banner_hidden():
            dist.init_process_group(backend="nccl" if backend == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if backend == "cuda" else None)
    return Runtime(backend, rank, world_size, local_rank, device)


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
