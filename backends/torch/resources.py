"""What the metrics report about a torch rank's device: its memory, and the device kind and matmul timing behind
MFU's peak (the rule itself is portable_fsdp.hardware's).

On a GPU, memory is what the caching allocator says — the bytes tensors hold (allocated) and the bytes it keeps
from the driver (reserved: fragmentation and cached blocks are what run a GPU out of memory) — and the base is
what the device had in use before the model existed: the CUDA context, NCCL's buffers and the libraries'
workspaces, which no allocator counter sees. On the CPU every figure is the process's resident set.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from portable_fsdp import host_memory
from portable_fsdp.backends.hf_torch import matmul

MiB = 2**20


def memory_mb(device: torch.device) -> dict:
    """{mem_mb, peak_mem_mb, reserved_mb, peak_reserved_mb} of this process on `device` now."""
    if device.type == "cuda":
        return {"mem_mb": torch.cuda.memory_allocated(device) / MiB,
                "peak_mem_mb": torch.cuda.max_memory_allocated(device) / MiB,
                "reserved_mb": torch.cuda.memory_reserved(device) / MiB,
                "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / MiB}
    now, peak = host_memory.resident_mb(), host_memory.peak_resident_mb()
    return {"mem_mb": now, "peak_mem_mb": peak, "reserved_mb": now, "peak_reserved_mb": peak}


def in_use_mb(device: torch.device) -> float:
    """What `device` has in use: on a GPU everything the driver handed out (CUDA context, NCCL, the allocator's
    reserve: total - free), on the CPU this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / MiB
    return host_memory.resident_mb()


def shared_mb(device: torch.device) -> float:
    """Shared memory in the resident set (the CPU collectives' buffers); 0 on a GPU."""
    return host_memory.shared_resident_mb() if device.type == "cpu" else 0.0


def device_kind(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)


def time_all_reduce(device: torch.device, size: int) -> float:
    """Seconds of one all-reduce of `size` bytes over the world group (NCCL on GPUs, gloo on the CPU), from every
    rank's operand ready (a barrier) to this rank's result ready."""
    operand = torch.ones(size // 4, dtype=torch.float32, device=device)
    _wait(device)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(operand)
    _wait(device)
    return time.perf_counter() - start


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(device: torch.device, size: int, dtype: str) -> float:
    """Seconds of one size x size product on `device` (the primitive of portable_fsdp.hardware)."""
    return matmul.time_matmul(device, size, dtype, lambda: _wait(device))
