"""What the metrics report about a torch rank's device: its memory, and the device kind and matmul timing behind
MFU's peak (the rule itself is portable_fsdp.machine.hardware's).

On a GPU, memory is what the caching allocator says — the bytes tensors hold (allocated) and the bytes it keeps
from the driver (reserved: fragmentation and cached blocks are what run a GPU out of memory) — and the base is
what the device had in use before the model existed: the CUDA context, NCCL's buffers and the libraries'
workspaces, which no allocator counter sees. On the CPU every figure is the process's resident set.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from portable_fsdp.machine import host_memory
from portable_fsdp.backends.hf_torch import matmul

if TYPE_CHECKING:
    from portable_fsdp.backends.torch.step import TrainState

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


def device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)


def all_reduce_seconds(device: torch.device, size: int) -> float:
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


def matmul_seconds(device: torch.device, size: int, dtype: str) -> float:
    """Seconds of one size x size product on `device` (the primitive of portable_fsdp.machine.hardware)."""
    return matmul.time_matmul(device, size, dtype, lambda: _wait(device))


# ---- the backend contract's functions (portable_fsdp/backend.py) that read them


def _local_bytes(tensors) -> int:
    """Bytes of this rank's pieces of `tensors` (a DTensor's local shard, a plain tensor whole)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def _state_bytes(state: TrainState) -> int:
    """Bytes of parameters and optimizer state held by this rank."""
    optimizer_state = (v for per_param in state.optimizer.state.values() for v in per_param.values() if torch.is_tensor(v))
    return _local_bytes(state.model.parameters()) + _local_bytes(optimizer_state)


def _gradient_bytes(state: TrainState) -> int:
    """Bytes of this rank's gradient shards (one per trainable parameter shard, in its dtype), held from
    the backward to the update; freed in between, so counted rather than read."""
    return _local_bytes(p for p in state.model.parameters() if p.requires_grad)


def memory_report(state: TrainState) -> dict:
    """Per-rank memory in MiB (a collective: every rank must call it), the keys of MEMORY_KEYS: mem_mb /
    peak_mem_mb / reserved_mb / peak_reserved_mb as torch/resources.py reads them (allocated and reserved by
    the caching allocator on CUDA, the resident set on CPU); `state_mb`: parameters and optimizer state this
    rank holds; `grad_mb`: its gradient shards, held during a step (with grad_accum_steps > 1, FSDP2 holds
    unsharded gradients between micro-batches); `base_mem_mb`: memory in use before the model existed
    (libraries, process group; on CUDA the context and NCCL's buffers too); `shm_mb`: shared memory in mem_mb."""
    device = state.ctx.runtime.device
    keys = ("mem_mb", "peak_mem_mb", "reserved_mb", "peak_reserved_mb", "state_mb", "grad_mb", "base_mem_mb",
            "shm_mb")
    mine = {**memory_mb(device), "state_mb": _state_bytes(state) / 2**20,
            "grad_mb": _gradient_bytes(state) / 2**20, "base_mem_mb": state.ctx.baseline_mb,
            "shm_mb": shared_mb(device)}
    local = torch.tensor([mine[key] for key in keys], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    rows = np.array([g.tolist() for g in gathered])
    return {key: rows[:, i].round(2 if key in ("state_mb", "grad_mb") else 1).tolist() for i, key in enumerate(keys)}


def device_kind(state: TrainState) -> str:
    return device_name(state.ctx.runtime.device)


def time_matmul(state: TrainState, size: int, dtype: str) -> float:
    return matmul_seconds(state.ctx.runtime.device, size, dtype)


def time_all_reduce(state: TrainState, size: int) -> float:
    return all_reduce_seconds(state.ctx.runtime.device, size)


_profiler = None  # the torch.profiler.profile running between start_trace and stop_trace


def start_trace(state: TrainState, directory) -> None:
    """torch.profiler over the host and, on CUDA, the GPU; one Chrome trace per rank (`rank<N>.*.pt.trace.json`)
    that TensorBoard's profiler plugin and Perfetto open."""
    global _profiler
    activities = [torch.profiler.ProfilerActivity.CPU]
    if state.ctx.runtime.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # kineto reports its probe for a GPU as an ERROR line on a machine without one
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    handler = torch.profiler.tensorboard_trace_handler(str(directory), worker_name=f"rank{dist.get_rank()}")
    _profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler, profile_memory=True)
    _profiler.start()


def step_annotation(state: TrainState, step: int):
    return torch.profiler.record_function(f"step {step}")


def stop_trace(state: TrainState) -> None:
    global _profiler
    _profiler.stop()  # without a schedule, stopping hands the trace to on_trace_ready
    _profiler = None


_snapshot_path = None  # where a CUDA out-of-memory writes the allocator's history (set by watch_memory)


def watch_memory(state: TrainState, path) -> bool:
    """On CUDA: record the caching allocator's history of allocations and frees, so that a step running out of
    memory writes it to `path` (a pickle pytorch.org/memory_viz opens) before the error. The history exists on
    CUDA only."""
    global _snapshot_path
    if state.ctx.runtime.device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # the most recent events: bounded memory
    _snapshot_path = path
    return True


@contextlib.contextmanager
def snapshot_on_out_of_memory():
    """Around a step: a CUDA out-of-memory first writes the watched history (watch_memory), then goes on."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        if _snapshot_path:
            torch.cuda.memory._dump_snapshot(str(_snapshot_path))
            print(f"memory snapshot of the out-of-memory step: {_snapshot_path} (open it at pytorch.org/memory_viz)",
                  file=sys.stderr, flush=True)
        raise
