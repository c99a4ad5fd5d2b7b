"""The process environment torch_xla reads once, when its runtime starts: set here, before anything touches a
device, and the questions that can be answered without starting the runtime (which device, how many)."""
from __future__ import annotations

import os


def configure(cpu_devices: int) -> None:
    """`cpu_devices` PJRT CPU devices if the run lands on the CPU.

    PJRT_DEVICE is left alone: unset, torch_xla picks TPU where libtpu is installed and CPU elsewhere, so a
    TPU VM never silently trains on its host. CPU_NUM_DEVICES is read only by the CPU client."""
    os.environ["CPU_NUM_DEVICES"] = str(cpu_devices)
    # XLA logs a GSPMD deprecation warning at every compilation; errors still show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # transformers must not take the XLA code paths of its Trainer; the model code is the same either way.
    os.environ.setdefault("USE_TORCH_XLA", "0")


def device_type() -> str:
    """"CPU", "TPU", ... — imports torch_xla (which settles PJRT_DEVICE) but does not start its runtime."""
    import torch_xla.runtime as xr

    return xr.device_type()


def spmd_device_count(device: str, cpu_devices: int) -> int:
    """Devices one SPMD program spans: every device of the slice (on a TPU this starts the runtime, in SPMD
    mode as the worker in this same process needs it)."""
    if device == "CPU":
        return cpu_devices
    import torch_xla.runtime as xr

    xr.use_spmd()
    return xr.global_runtime_device_count()


def v1_process_count(device: str) -> int:
    """Processes FSDP v1 runs (one per device), counted without starting the runtime: xmp.spawn refuses to
    start once the parent has started it. Only CPU (one device) and TPU are launched here."""
    if device == "CPU":
        return 1
    from torch_xla._internal import tpu

    return tpu.num_expected_global_devices()
