"""The registry of lowerings: one sub-package per framework, each imported only when chosen. The one place
that knows the backends by name; everything the core asks of one goes through its module (the `Backend`
contract, portable_fsdp/backend.py)."""
from __future__ import annotations

import importlib

from portable_fsdp.machine import tpu_vm
from portable_fsdp.errors import UserError

# --backend name -> the module that lowers the plan for it (cpu and cuda share one).
BACKENDS = {
    "cpu": "portable_fsdp.backends.torch",
    "cuda": "portable_fsdp.backends.torch",
    "xla": "portable_fsdp.backends.xla",
    "flax": "portable_fsdp.backends.flax",
}
CHOICES = ("auto", *BACKENDS)
DEFAULT = "cpu"  # where no accelerator is asked for


def load(name: str):
    return importlib.import_module(BACKENDS[name])


def check_name(name: str, field: str) -> None:
    if name not in BACKENDS:
        raise UserError(field, f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


def resolve(name: str, config=None) -> str:
    """`auto`: xla on a TPU VM or when the config asks for torch_xla (Hugging Face's `xla: true`), else cuda when
    a GPU is visible, else cpu."""
    if name == "auto" and ((config is not None and config.plan.xla) or tpu_vm.tpu_visible()):
        return "xla"
    if name in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return "cuda"
        if name == "cuda":
            raise UserError("--backend", "cuda was asked for but no GPU is visible; use --backend cpu")
        return "cpu"
    return name


def for_device(name: str, label: str | None, config) -> str:
    """--backend of `python -m portable_fsdp.estimate`: `auto` is xla for a TPU (`label`: the datasheet device
    named by --device) or a config asking for torch_xla, cuda for a GPU, the default for host memory (None)."""
    if name != "auto":
        return name
    if config.plan.xla or (label or "").startswith("TPU"):
        return "xla"
    return "cuda" if label else DEFAULT
