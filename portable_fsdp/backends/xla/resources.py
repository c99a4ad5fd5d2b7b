"""What the metrics report about a torch_xla run's devices: their memory, and the device kind behind MFU's peak.

Under SPMD one process drives every device of its host through a virtual device ("SPMD:0") that torch_xla's
runtime queries do not accept ("Unknown device SPMD:0"; "MemoryInfo not supported for SPMD virtual device"): the
chip is named by the TPU VM's accelerator type (TPU_ACCELERATOR_TYPE, else the VM's metadata), and HBM is read
from libtpu's monitoring SDK (one figure per device, no peak: the largest seen is kept). FSDP v1 (one process per
device) asks torch_xla about its own device. PJRT CPU devices are this process's host memory.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.profiler as xp
import torch_xla.distributed.spmd as xs

from portable_fsdp.machine import host_memory, tpu_vm
from portable_fsdp.backends.hf_torch import matmul
from portable_fsdp.backends.xla import runtime as rt

if TYPE_CHECKING:
    from portable_fsdp.backends.xla.step import TrainState

MiB = 2**20
_largest_seen: dict = {}  # device index -> the most HBM libtpu reported in use on it (it keeps no peak itself)


def device_name(spmd: bool, device_type: str) -> str:
    """The device as portable_fsdp.machine.hardware's datasheet looks it up: "cpu" on PJRT CPU; under SPMD on a TPU the
    accelerator type ("TPU v5p-8"; the bare device type when it cannot be read, so the peak is measured); the
    PJRT device kind of this process's device under FSDP v1 ("TPU v5")."""
    if device_type == "CPU":
        return "cpu"
    if spmd:
        kind = tpu_vm.accelerator_type() if device_type == "TPU" else ""
        return f"TPU {kind}" if kind else device_type
    return _pjrt_device_kind()


def _pjrt_device_kind() -> str:
    import torch_xla.core.xla_model as xm

    return xm.xla_device_kind()


def _memory_info(device) -> dict:
    import torch_xla.core.xla_model as xm

    return xm.get_memory_info(device)


def memory_mb(spmd: bool, device_type: str, devices: int, device=None) -> list:
    """[{mem_mb, peak_mem_mb, reserved_mb, peak_reserved_mb}] for each of this process's `devices` (FSDP v1: its
    one `device`): HBM on a TPU, the process's resident set on PJRT CPU devices (the same for each)."""
    if device_type == "CPU":
        now, peak = host_memory.resident_mb(), host_memory.peak_resident_mb()
        return [{"mem_mb": now, "peak_mem_mb": peak, "reserved_mb": now, "peak_reserved_mb": peak}] * devices
    if not spmd:
        info = _memory_info(device)
        used, peak = int(info["bytes_used"]) / MiB, int(info["peak_bytes_used"]) / MiB
        return [{"mem_mb": used, "peak_mem_mb": peak, "reserved_mb": used, "peak_reserved_mb": peak}]
    return hbm_rows(_libtpu_hbm_usage(), devices)


def hbm_rows(usage: list | None, devices: int) -> list:
    """Rows of libtpu's HBM figures (bytes per device, as text), the largest seen as the peak; zeros (with one
    warning) when libtpu gives none for these devices."""
    if usage is None or len(usage) != devices:
        _warn_once("libtpu's monitoring SDK gives no HBM figures here (libtpu with libtpu.sdk is needed): memory "
                   "per device is reported as 0; state_mb and grad_mb still say what each device holds")
        return [dict.fromkeys(("mem_mb", "peak_mem_mb", "reserved_mb", "peak_reserved_mb"), 0.0)] * devices
    rows = []
    for index, value in enumerate(usage):
        now = int(value) / MiB
        _largest_seen[index] = max(now, _largest_seen.get(index, 0.0))
        rows.append({"mem_mb": now, "peak_mem_mb": _largest_seen[index], "reserved_mb": now,
                     "peak_reserved_mb": _largest_seen[index]})
    return rows


def _libtpu_hbm_usage() -> list | None:
    try:
        from libtpu import sdk
    except ImportError:
        return None
    monitoring = getattr(sdk, "tpumonitoring", None) or getattr(sdk, "monitoring", None)
    try:
        return list(monitoring.get_metric("hbm_capacity_usage").data())
    except Exception:  # an SDK without the metric, or no TPU workload registered with it
        return None


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


# ---- the backend contract's functions (portable_fsdp/backend.py) that read them


def _state_tensors(state: TrainState) -> list:
    """Parameters and optimizer state (what sharding is for)."""
    return [n.param for n in state.ctx.named] + [v for s in state.optimizer.state.values() for v in s.values()
                                                 if torch.is_tensor(v) and v.device.type == "xla"]


def _gradient_tensors(state: TrainState) -> list:
    """Stand-ins for the gradients: one per trainable parameter shard, in its dtype, held from the backward to
    the update (freed in between, so counted rather than read), as the torch backend counts them."""
    return [n.param for n in state.ctx.named if n.param.requires_grad]


def _bytes_per_device(state: TrainState, tensors: list, key: str) -> list:
    """Bytes of `tensors` each device holds."""
    runtime = state.ctx.runtime
    if not runtime.spmd:
        mine = sum(t.numel() * t.element_size() for t in tensors)
        return xm.mesh_reduce(f"portable_fsdp.{key}", [mine], lambda parts: sum(parts, []))
    xm.wait_device_ops()  # shard layouts are read from the data, which the last update may still be writing
    per_device = [0] * runtime.world_size
    for tensor, shards in zip(tensors, torch_xla._XLAC._get_local_shard_replica_and_indices(tensors)):
        for device_index, (_, indices) in enumerate(shards):
            count = tensor.numel() if indices is Ellipsis else math.prod(s.stop - s.start for s in indices)
            per_device[device_index] += count * tensor.element_size()
    return per_device


def memory_report(state: TrainState) -> dict:
    """Per device (the plan's ranks), in MiB, the keys of MEMORY_KEYS: each device's memory as
    portable_fsdp/backends/xla/resources.py reads it (HBM on a TPU; the host process's resident set, given for each device it
    drives, on PJRT CPU), base_mem_mb (before the model existed) and shm_mb; state_mb and grad_mb are what each
    device holds."""
    runtime = state.ctx.runtime
    state_mb = [round(b / 2**20, 2) for b in _bytes_per_device(state, _state_tensors(state), "state_bytes")]
    grad_mb = [round(b / 2**20, 2) for b in _bytes_per_device(state, _gradient_tensors(state), "grad_bytes")]
    shared = host_memory.shared_resident_mb() if runtime.device_type == "CPU" else 0.0
    mine = [{**row, "base_mem_mb": state.ctx.baseline_mb, "shm_mb": shared}
            for row in memory_mb(runtime.spmd, runtime.device_type, len(state_mb) if runtime.spmd else 1,
                                           runtime.device)]
    rows = mine if runtime.spmd else xm.mesh_reduce("portable_fsdp.memory", mine, lambda parts: sum(parts, []))
    return {**{key: [round(row[key], 1) for row in rows] for key in mine[0]}, "state_mb": state_mb,
            "grad_mb": grad_mb}


def device_kind(state: TrainState) -> str:
    """The device MFU's datasheet peak is looked up by (portable_fsdp/backends/xla/resources.py)."""
    return device_name(state.ctx.runtime.spmd, state.ctx.runtime.device_type)


def time_matmul(state: TrainState, size: int, dtype: str) -> float:
    """Seconds of one size x size product on one device. Under SPMD the operands are replicated, so every
    device of the process runs its own copy at once, as portable_fsdp.machine.hardware asks."""
    return matmul.time_matmul(state.ctx.runtime.device, size, dtype, xm.wait_device_ops)


def time_all_reduce(state: TrainState, size: int) -> float:
    """Seconds of one all-reduce of `size` bytes over every device: under SPMD one row per device, summed into a
    replicated result (the compiler's all-reduce); under FSDP v1 xm.all_reduce over the processes."""
    runtime = state.ctx.runtime
    if runtime.spmd:
        operand = torch.ones(runtime.world_size, size // 4, device=runtime.device)  # one row made on each device
        xs.mark_sharding(operand, runtime.mesh, (tuple(runtime.mesh.axis_names), None))
        rt.sync()
        xm.wait_device_ops()
        start = time.perf_counter()
        summed = operand.sum(dim=0)
    else:
        operand = torch.ones(size // 4, device=runtime.device)
        rt.sync()
        xm.wait_device_ops()
        rt.barrier(runtime)
        start = time.perf_counter()
        summed = xm.all_reduce(xm.REDUCE_SUM, operand)
    rt.sync()  # runs the graph of what is still referenced: `summed` must be alive here
    xm.wait_device_ops()
    seconds = time.perf_counter() - start
    del summed
    return seconds


def start_trace(state: TrainState, directory) -> None:
    """torch_xla's profiler (host and device activity): an XPlane trace under <directory>/plugins/profile/ that
    TensorBoard's profiler plugin and Perfetto open."""
    xp.start_trace(str(directory))


def step_annotation(state: TrainState, step: int):
    # The host-side mark under xp.Trace / xp.StepTrace: those also push an IR scope, which names the step's
    # operations (graphs that differ per step) and, in StepTrace, refuses the sync a step ends with.
    return torch_xla._XLAC.profiler.TraceMe(f"step {step}")


def stop_trace(state: TrainState) -> None:
    xp.stop_trace()


def watch_memory(state: TrainState, path) -> bool:
    return False  # an allocator history to snapshot is CUDA's (torch.cuda.memory)
