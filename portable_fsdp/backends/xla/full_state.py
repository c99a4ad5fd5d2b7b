"""Moving between a device tensor as training holds it and the full tensor a checkpoint holds.

SPMD: a parameter is one global tensor, sharded; reading it gathers every device's shard, and a full tensor is
placed back with the same sharding annotation. FSDP v1: each process holds a flat 1-D chunk of the flattened,
zero-padded parameter; all processes gather the chunks (a collective: all must call, in the same order).
"""
from __future__ import annotations

import math

import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn

from portable_fsdp.backends.xla.runtime import Runtime


def gather(runtime: Runtime, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The full tensor on the host, gathered from every shard (not only this process's)."""
    if runtime.spmd:
        return tensor.detach().cpu()
    flat = xm.all_gather(tensor.detach().flatten(), dim=0)
    return flat[: math.prod(shape)].reshape(shape).cpu()


def place(runtime: Runtime, like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (host) as a device tensor laid out like `like`: same dtype, sharding (SPMD) or chunk (v1).

    An in-place copy into a sharded tensor would drop its sharding (the copy takes the source's), so the new
    tensor is built sharded and replaces the old one's data."""
    full = full.to(like.dtype)
    if runtime.spmd:
        placed = full.to(runtime.device)
        sharding = torch_xla._XLAC._get_xla_op_sharding(like)
        if sharding:
            torch_xla._XLAC._xla_mark_sharding(placed, sharding)
        return placed
    flat = full.flatten()
    padded = torch.zeros(like.numel() * runtime.world_size, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    return padded.chunk(runtime.world_size)[runtime.rank].clone().to(runtime.device)


def persistent_buffers(model: nn.Module) -> dict:
    """Buffers a state dict holds (not e.g. rotary inv_freq), on the host, in their original dtype (v1 casts
    buffers to its compute dtype and remembers the original)."""
    from portable_fsdp.backends.xla.params import unwrapped_name

    buffers = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full_name = unwrapped_name(f"{module_name}.{name}" if module_name else name)
            buffers[full_name] = buffer.detach().to(getattr(buffer, "_orig_dtype", buffer.dtype)).cpu()
    return buffers
