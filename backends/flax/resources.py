"""What the metrics report about the devices: memory per device, and the device kind and matmul timing behind
MFU's peak (the rule itself is portable_fsdp.hardware's)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from portable_fsdp import host_memory
from portable_fsdp.backends.flax import processes

if TYPE_CHECKING:
    from portable_fsdp.backends.flax.step import TrainState


def _bytes_per_device(leaves) -> dict:
    held: dict = {}
    for leaf in leaves:
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def _device_stats(device) -> dict | None:
    """Allocator statistics of an accelerator; None for host CPU devices, which share this process's memory."""
    return device.memory_stats() if device.platform != "cpu" else None


def memory_now_mb(device) -> float:
    """Bytes in use on an accelerator; this process's resident set for a host CPU device."""
    stats = _device_stats(device)
    return stats.get("bytes_in_use", 0) / 2**20 if stats else host_memory.resident_mb()


def reported_devices(mesh) -> list:
    """The devices memory is reported for: every device of the mesh, or this process's when there are several
    (another machine's memory cannot be read from here)."""
    return processes.local_devices(mesh) if processes.several() else list(mesh.devices.flat)


def memory_report(state: TrainState) -> dict:
    """Per-device MiB (this process's devices), the keys of MEMORY_KEYS. Host CPU devices share this process's memory, so there mem_mb,
    peak_mem_mb, base_mem_mb (before the model existed) and shm_mb are the process's (the same number for every
    device); state_mb (parameters and optimizer state) and grad_mb (one gradient per parameter shard, held
    during a step, counted rather than read) are what each device holds."""
    devices = reported_devices(state.ctx.mesh)
    held = _bytes_per_device(jax.tree.leaves((state.params, state.opt_state)))
    grads = _bytes_per_device(jax.tree.leaves(state.params))  # the flax lowering trains every parameter
    current, peak, shared = [], [], []
    for device in devices:
        stats = _device_stats(device)
        current.append(memory_now_mb(device))
        peak.append(stats.get("peak_bytes_in_use", 0) / 2**20 if stats else host_memory.peak_resident_mb())
        shared.append(0.0 if stats else host_memory.shared_resident_mb())
    baseline = state.ctx.baseline_mb or (0.0,) * len(devices)
    return {"mem_mb": [round(m, 1) for m in current], "peak_mem_mb": [round(m, 1) for m in peak],
            "state_mb": [round(held.get(d, 0) / 2**20, 2) for d in devices],
            "grad_mb": [round(grads.get(d, 0) / 2**20, 2) for d in devices],
            "base_mem_mb": [round(m, 1) for m in baseline], "shm_mb": [round(m, 1) for m in shared]}


def device_kind(state: TrainState) -> str:
    device = state.ctx.mesh.devices.flat[0]
    return "cpu" if device.platform == "cpu" else device.device_kind


_matmul = jax.jit(lambda x, y: x @ y)  # the output keeps the operands' (replicated) sharding


def time_matmul(state: TrainState, size: int, dtype: str) -> float:
    """Seconds of one size x size product: the operands replicated over the mesh, so every device computes its
    own copy at once (host CPU devices share the cores, as portable_fsdp.hardware asks)."""
    replicated = jax.sharding.NamedSharding(state.ctx.mesh, jax.sharding.PartitionSpec())
    a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype), replicated)
    a.block_until_ready()
    start = time.perf_counter()
    _matmul(a, a).block_until_ready()  # compiled once per shape and dtype, in hardware's warm-up
    return time.perf_counter() - start
