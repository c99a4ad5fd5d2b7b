"""What the metrics report about the devices: memory per device and the matmul rate behind MFU."""
from __future__ import annotations

import math
import resource
import time

import jax
import jax.numpy as jnp
import psutil

from portable_fsdp.backends.flax.step import TrainState


def _state_bytes_per_device(state: TrainState) -> dict:
    held: dict = {}
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def memory_report(state: TrainState) -> dict:
    """Per-device MiB. Host CPU devices share this process's memory, so there mem_mb / peak_mem_mb are the
    process's (the same number for every device); state_mb is what each device holds."""
    devices = list(state.ctx.mesh.devices.flat)
    held = _state_bytes_per_device(state)
    current, peak = [], []
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats:
            current.append(stats.get("bytes_in_use", 0) / 2**20)
            peak.append(stats.get("peak_bytes_in_use", 0) / 2**20)
        else:
            current.append(psutil.Process().memory_info().rss / 2**20)
            peak.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)
    return {"mem_mb": [round(m, 1) for m in current], "peak_mem_mb": [round(m, 1) for m in peak],
            "state_mb": [round(held.get(d, 0) / 2**20, 2) for d in devices]}


def peak_flops_per_device(devices: list) -> float:
    """The float32 matmul rate one device reaches. Host CPU devices share the cores, so the rate one of
    them measures (using every core) is split between them."""
    size = 1024
    a = jax.device_put(jnp.ones((size, size), jnp.float32), devices[0])
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    rate = 2 * size**3 / best
    return rate / len(devices) if devices[0].platform == "cpu" else rate


def peak_flops(state: TrainState) -> float:
    configured = state.ctx.config.train.peak_flops_per_device
    return configured or peak_flops_per_device(list(state.ctx.mesh.devices.flat))
