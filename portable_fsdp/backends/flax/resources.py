"""What the metrics report about the devices: memory per device, and the device kind and matmul timing behind
MFU's peak (the rule itself is portable_fsdp.machine.hardware's)."""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from portable_fsdp.machine import host_memory
from portable_fsdp.backends.flax import processes

if TYPE_CHECKING:
    from portable_fsdp.backends.flax.step import TrainState


def _bytes_per_device(leaves) -> dict:
    held: dict = {}
    for leaf in leaves:
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def device_memory_mb(device) -> dict:
    """{mem_mb, peak_mem_mb, reserved_mb, peak_reserved_mb} of `device`: on an accelerator, its allocator's bytes
    in use (now, at peak) and the bytes it holds (GPU: the pool it preallocated; else what it reserved); on a
    host CPU device, which shares this process's memory, the process's resident set. An accelerator whose
    allocator gives no statistics (XLA_PYTHON_CLIENT_ALLOCATOR=platform) reports 0, never the host's memory."""
    if device.platform == "cpu":
        now, peak = host_memory.resident_mb(), host_memory.peak_resident_mb()
        return {"mem_mb": now, "peak_mem_mb": peak, "reserved_mb": now, "peak_reserved_mb": peak}
    stats = device.memory_stats() or {}
    in_use, peak = stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)
    held = stats.get("pool_bytes") or stats.get("bytes_reserved") or in_use
    held_peak = stats.get("peak_pool_bytes") or stats.get("peak_bytes_reserved") or peak
    return {"mem_mb": in_use / 2**20, "peak_mem_mb": peak / 2**20, "reserved_mb": held / 2**20,
            "peak_reserved_mb": held_peak / 2**20}


def reported_devices(mesh) -> list:
    """The devices memory is reported for: every device of the mesh, or this process's when there are several
    (another machine's memory cannot be read from here)."""
    return processes.local_devices(mesh) if processes.several() else list(mesh.devices.flat)


def memory_report(state: TrainState) -> dict:
    """Per-device MiB (this process's devices), the keys of MEMORY_KEYS (`device_memory_mb`). Host CPU devices
    share this process's memory, so there the memory figures, base_mem_mb (before the model existed) and shm_mb
    are the process's (the same number for every device); state_mb (parameters and optimizer state) and grad_mb
    (one gradient per parameter shard, held during a step, counted rather than read) are what each device holds."""
    devices = reported_devices(state.ctx.mesh)
    held = _bytes_per_device(jax.tree.leaves((state.params, state.opt_state)))
    grads = _bytes_per_device(jax.tree.leaves(state.params))  # the flax lowering trains every parameter
    rows = [device_memory_mb(device) for device in devices]
    shared = [host_memory.shared_resident_mb() if device.platform == "cpu" else 0.0 for device in devices]
    baseline = state.ctx.baseline_mb or (0.0,) * len(devices)
    return {**{key: [round(row[key], 1) for row in rows] for key in rows[0]},
            "state_mb": [round(held.get(d, 0) / 2**20, 2) for d in devices],
            "grad_mb": [round(grads.get(d, 0) / 2**20, 2) for d in devices],
            "base_mem_mb": [round(m, 1) for m in baseline], "shm_mb": [round(m, 1) for m in shared]}


def device_kind(state: TrainState) -> str:
    device = state.ctx.mesh.devices.flat[0]
    return "cpu" if device.platform == "cpu" else device.device_kind


_matmul = jax.jit(lambda x, y: x @ y)  # the output keeps the operands' (replicated) sharding


@functools.lru_cache(maxsize=4)
def _operand(mesh, size: int, dtype: str):
    """A random size x size operand made on every device of `mesh` at once (replicated): no host copy of it, and
    with several processes no check that every host sent the same bytes."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    make = jax.jit(lambda key: jax.random.normal(key, (size, size), jnp.dtype(dtype)), out_shardings=replicated)
    return make(jax.random.key(0))


@functools.lru_cache(maxsize=4)
def _all_reduce_program(mesh, size: int):
    """(operand, program): a float32 array of one `size`-byte row per device of `mesh`, made on the devices, and
    the jitted sum of its rows into a replicated result: XLA's all-reduce over every device."""
    devices = mesh.devices.size
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    operand = jax.jit(lambda: jnp.ones((devices, size // 4), jnp.float32), out_shardings=rows)()
    return operand, jax.jit(lambda x: x.sum(axis=0), out_shardings=replicated)


def time_all_reduce(state: TrainState, size: int) -> float:
    """Seconds of one all-reduce of `size` bytes over every device of the mesh (each device's row summed)."""
    operand, program = _all_reduce_program(state.ctx.mesh, size)
    operand.block_until_ready()
    start = time.perf_counter()
    program(operand).block_until_ready()  # compiled once per size, in hardware's warm-up
    return time.perf_counter() - start


def time_matmul(state: TrainState, size: int, dtype: str) -> float:
    """Seconds of one size x size product: the operands replicated over the mesh, so every device computes its
    own copy at once (host CPU devices share the cores, as portable_fsdp.machine.hardware asks)."""
    a = _operand(state.ctx.mesh, size, dtype)
    a.block_until_ready()
    start = time.perf_counter()
    _matmul(a, a).block_until_ready()  # compiled once per shape and dtype, in hardware's warm-up
    return time.perf_counter() - start


def start_trace(state: TrainState, directory) -> None:
    """jax.profiler: an XPlane trace under <directory>/plugins/profile/ that TensorBoard's profiler plugin and
    Perfetto open."""
    jax.profiler.start_trace(str(directory))


def step_annotation(state: TrainState, step: int):
    return jax.profiler.StepTraceAnnotation("train", step_num=step)


def stop_trace(state: TrainState) -> None:
    jax.profiler.stop_trace()


def watch_memory(state: TrainState, path) -> bool:
    return False  # an allocator history to snapshot is CUDA's (torch.cuda.memory)
