"""Lowerings of the neutral plan, one sub-package per framework, each imported only when chosen."""
from __future__ import annotations

import importlib

from portable_fsdp.errors import UserError

# --backend name -> (module, None) when built, or (None, the product issue it waits for).
BACKENDS = {
    "cpu": ("portable_fsdp.backends.torch", None),
    "cuda": ("portable_fsdp.backends.torch", None),
    "xla": ("portable_fsdp.backends.xla", None),
    "flax": ("portable_fsdp.backends.flax", None),
}
CHOICES = ("auto", *BACKENDS)


def load(name: str):
    module, waits_for = BACKENDS[name]
    if module is None:
        raise UserError("--backend", f"{name} is not built yet (it waits for {waits_for}); use --backend cpu or cuda")
    return importlib.import_module(module)
