"""What the metrics report about a torch_xla run's devices: their memory, and the device kind behind MFU's peak.

Under SPMD one process drives every device of its host through a virtual device ("SPMD:0") that torch_xla's
runtime queries do not accept ("Unknown device SPMD:0"; "MemoryInfo not supported for SPMD virtual device"): the
chip is named by the TPU VM's accelerator type (TPU_ACCELERATOR_TYPE, else the VM's metadata), and HBM is read
from libtpu's monitoring SDK (one figure per device, no peak: the largest seen is kept). FSDP v1 (one process per
device) asks torch_xla about its own device. PJRT CPU devices are this process's host memory.
"""
from __future__ import annotations

import warnings

from portable_fsdp import host_memory, tpu_vm

MiB = 2**20
_largest_seen: dict = {}  # device index -> the most HBM libtpu reported in use on it (it keeps no peak itself)


def device_kind(spmd: bool, device_type: str) -> str:
    """The device as portable_fsdp.hardware's datasheet looks it up: "cpu" on PJRT CPU; under SPMD on a TPU the
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
