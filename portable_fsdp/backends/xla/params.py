"""The wrapped model's parameters under the names of the unwrapped transformers model, the names every
checkpoint uses (and `from_pretrained` loads).

SPMD FSDPv2 keeps each parameter (sharded in place) and only inserts `_orig_module.` into the names.
FSDP v1 replaces each parameter by a flat 1-D shard that remembers its original name (`_orig_name`, relative to
its FSDP unit) and shape (`_orig_size`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

SPMD_WRAPPER_SEGMENT = "_orig_module."
V1_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_fpw_module.")


@dataclasses.dataclass(frozen=True)
class NamedParameter:
    name: str  # as in the unwrapped transformers model
    param: nn.Parameter  # what the optimizer updates: the sharded global tensor (SPMD) or this rank's flat shard (v1)
    shape: torch.Size  # of the full, unsharded parameter


def unwrapped_name(name: str) -> str:
    for segment in (SPMD_WRAPPER_SEGMENT, *V1_WRAPPER_SEGMENTS):
        name = name.replace(segment, "")
    return name


def named_parameters(root: nn.Module, spmd: bool) -> list:
    if spmd:
        return [NamedParameter(unwrapped_name(n), p, p.shape) for n, p in root.named_parameters()]
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    named = []
    for path, unit in root.named_modules():
        if isinstance(unit, XlaFullyShardedDataParallel):
            for shard in unit.sharded_params:
                name = f"{path}.{shard._orig_name}" if path else shard._orig_name
                named.append(NamedParameter(unwrapped_name(name), shard, torch.Size(shard._orig_size)))
    return named
