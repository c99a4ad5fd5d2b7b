"""The primitive behind MFU's measured peak (portable_fsdp.machine.hardware) for both torch-based lowerings."""
from __future__ import annotations

import time
from typing import Callable

import torch


def time_matmul(device: torch.device, size: int, dtype: str, wait: Callable[[], None]) -> float:
    """Seconds of one size x size product of random operands on `device`, timed from an idle device (`wait`
    blocks until it is) to the product's sum read back on the host."""
    a = torch.randn(size, size, dtype=getattr(torch, dtype)).to(device)
    b = torch.randn(size, size, dtype=getattr(torch, dtype)).to(device)
    wait()
    start = time.perf_counter()
    (a @ b).sum().item()
    return time.perf_counter() - start
