"""The process environment torch_xla reads once, when its runtime starts: set here, before anything touches a
device, and the questions that can be answered without starting the runtime (which device, how many)."""
from __future__ import annotations

import os

from portable_fsdp.machine import tpu_vm
from portable_fsdp.errors import UserError

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
    """"CPU", "TPU", ... — imports torch_xla (which settles PJRT_DEVICE) but does not start its runtime. A host
    with TPU chips where torch_xla settles on the CPU (no libtpu: it only logs "Defaulting to PJRT_DEVICE=CPU")
    is one line, unless PJRT_DEVICE=CPU says so."""
    import torch_xla.runtime as xr

    device = xr.device_type()
    return checked_device(device, tpu_vm.tpu_visible(), os.environ.get("PJRT_DEVICE", ""))


def checked_device(device: str, tpu_attached: bool, asked: str) -> str:
    if device == "CPU" and tpu_attached and asked.upper() != "CPU":
        raise UserError("--backend", (
            "xla: this host has TPU chips but torch_xla found no TPU runtime and would train on the CPU; install "
            "it (pip install 'torch_xla[tpu]'), or set PJRT_DEVICE=CPU to train on the host"))
    return device


def spmd_device_count(device: str, cpu_devices: int) -> int:
    """Devices one SPMD program spans: every device of the slice, counted without starting the runtime (the
    start-up checks that follow may fork, which a started TPU runtime does not survive)."""
    return cpu_devices if device == "CPU" else _expected_tpu_devices()


def _expected_tpu_devices() -> int:
    """The slice's devices from its chips and workers (torch_xla reads PCI and the VM's metadata)."""
    from torch_xla._internal import tpu

    return tpu.num_expected_global_devices()


def v1_process_count(device: str) -> int:
    """Processes FSDP v1 runs (one per device), counted without starting the runtime: xmp.spawn refuses to
    start once the parent has started it. Only CPU (one device) and TPU are launched here."""
    if device == "CPU":
        return 1
    from torch_xla._internal import tpu

    return tpu.num_expected_global_devices()
