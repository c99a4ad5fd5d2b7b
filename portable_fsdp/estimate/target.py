"""What a run trains on: the backend, how many ranks, one rank's device and its memory (named on the command
line, read from the visible GPU or the TPU VM, or the host's memory)."""
from __future__ import annotations

import dataclasses

from portable_fsdp import backends

from portable_fsdp.machine import hardware, tpu_vm
from portable_fsdp.errors import UserError

HEADROOM = 0.10  # of each device's memory, left for what is not modelled (allocator, CUDA context, NCCL buffers)


@dataclasses.dataclass(frozen=True)
class Target:
    """What the run trains on: the backend, how many ranks, and one rank's device."""

    backend: str
    nproc: int
    device: str  # a hardware.DEVICE_MEMORY key, "cpu" (host memory), or "detected"
    label: str  # the device as its framework names it (DATASHEET matches it)
    memory: int  # bytes one rank may use (host memory: its share)
    headroom: float = HEADROOM

    @property
    def usable(self) -> float:
        return self.memory * (1.0 - self.headroom)

    @property
    def device_type(self) -> str:
        """What the capability table calls the device (cpu, cuda, tpu, gpu)."""
        if self.device == "cpu":
            return "cpu"
        return trained_as(self.backend, self.label) or device_kind(self.label)

    def with_nproc(self, nproc: int) -> "Target":
        if self.device == "cpu":  # ranks of one host share its memory
            return dataclasses.replace(self, nproc=nproc, memory=self.memory * self.nproc // nproc)
        return dataclasses.replace(self, nproc=nproc)


def tpu_from_environment() -> str | None:
    """The --device name of this Cloud TPU VM's chips, from its accelerator type (v4-8, v5litepod-16, v5p-8,
    v6e-8: TPU_ACCELERATOR_TYPE, else the VM's metadata), or None."""
    kind = tpu_vm.accelerator_type().lower()
    for prefix, name in (("v5litepod", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6e", "v6e"), ("v4", "v4")):
        if kind.startswith(prefix):
            return name
    return None


def device_kind(label: str) -> str:
    """A datasheet device's kind: "tpu" or "gpu"."""
    return "tpu" if label.startswith("TPU") else "gpu"


def trained_as(backend: str, label: str) -> str | None:
    """The device kind `backend` trains the device `label` as (`Backend.estimate_devices`: a GPU is "cuda" to
    the torch lowering, "gpu" to JAX), or None when it does not train on it."""
    kinds = backends.load(backend).estimate_devices(backend)
    kind = device_kind(label)
    return next((k for k in kinds if k == kind or (kind == "gpu" and k == "cuda")), None)


def resolve_target(backend: str, device: str, nproc: int | None) -> Target:
    """`device`: a DEVICE_MEMORY key, "cpu" for host memory, or "auto" (the backend's first device kind: the
    visible GPU on cuda, the TPU that TPU_ACCELERATOR_TYPE names on xla, host memory on cpu and flax)."""
    device = device.lower()
    if device == "auto":
        first = backends.load(backend).estimate_devices(backend)[0]
        device = {"cuda": "detected", "tpu": tpu_from_environment() or "unknown"}.get(first, "cpu")
        if device == "unknown":
            raise UserError("--device", "cannot tell which TPU this run trains on (TPU_ACCELERATOR_TYPE is not set); "
                            f"name it: --device {{{','.join(k for k in hardware.DEVICE_MEMORY if k[0] == 'v')}}}")
    if device == "detected":
        label, memory, visible = _visible_gpu()
        return Target(backend, nproc or visible, device, label, memory)
    nproc = nproc or (2 if device == "cpu" else 1)
    if device == "cpu":
        import psutil

        return Target(backend, nproc, "cpu", "cpu", psutil.virtual_memory().total // nproc)
    if device not in hardware.DEVICE_MEMORY:
        raise UserError("--device", f"unknown device {device!r}; choose one of "
                        f"{', '.join([*hardware.DEVICE_MEMORY, 'cpu'])}")
    label, memory = hardware.DEVICE_MEMORY[device]
    if trained_as(backend, label) is None:
        kinds = backends.load(backend).estimate_devices(backend)
        others = " or ".join(f"--backend {b}" for b in backends.BACKENDS if trained_as(b, label))
        if kinds == ("cpu",):
            raise UserError("--device", f"--backend {backend} trains in host memory (--device cpu); for {device} use "
                            f"{others}")
        raise UserError("--device", f"{device} is a {device_kind(label).upper()}; --backend {backend} trains on "
                        f"{' or '.join(kinds)} devices: estimate it with {others}")
    return Target(backend, nproc, device, label, memory)


def _visible_gpu() -> tuple:
    import torch

    if not torch.cuda.is_available():
        raise UserError("--device", "no GPU is visible to tell which one the run trains on; name it: --device "
                        f"{{{','.join(k for k in hardware.DEVICE_MEMORY if k[0] != 'v')}}}")
    properties = torch.cuda.get_device_properties(0)
    return properties.name, properties.total_memory, torch.cuda.device_count()
