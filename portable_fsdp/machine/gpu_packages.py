"""Which release of the GPU fast path's packages goes with which torch. Imports nothing: the GPU machine's set-up
(benchmarks/gpu_setup.py) reads it before anything is installed, and the float8 lowering names it in its errors.

torchao's compiled parts load only into the torch they were built for (its own compatibility table,
torchao/__init__.py): 0.14.1 for torch 2.9, 0.16.0 for 2.10; 0.17.0 refuses anything older than 2.11."""
from __future__ import annotations

import re

TORCHAO = {(2, 9): "0.14.1", (2, 10): "0.16.0"}
TORCHAO_NEWEST = "0.17.0"  # torch 2.11 and later


def torchao_for(torch_version: str) -> str:
    """The torchao release built for `torch_version` ("2.11.0+cu130"); ValueError before torch 2.9."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    if (major, minor) < (2, 9):
        raise ValueError(f"torch {torch_version}: the product needs torch 2.9 or newer")
    return TORCHAO.get((major, minor), TORCHAO_NEWEST)
