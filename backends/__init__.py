"""Lowerings of the neutral plan, one sub-package per framework, each imported only when chosen."""
from __future__ import annotations

import importlib

# --backend name -> the module that lowers the plan for it (cpu and cuda share one).
BACKENDS = {
    "cpu": "portable_fsdp.backends.torch",
    "cuda": "portable_fsdp.backends.torch",
    "xla": "portable_fsdp.backends.xla",
    "flax": "portable_fsdp.backends.flax",
}
CHOICES = ("auto", *BACKENDS)


def load(name: str):
    return importlib.import_module(BACKENDS[name])
