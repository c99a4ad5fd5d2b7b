"""DTensors whose local piece is not where their mesh computes: FSDP2's CPU offload keeps each shard in host
memory while its mesh is the GPUs'. A collective on such a piece goes to the mesh's process group, and NCCL has no
CPU backend ("No backend type associated with device type cpu"): the piece is moved to the mesh's device first,
as torch's own full-state-dict code does (torch/distributed/_state_dict_utils.py)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def gather_device(tensor: DTensor) -> str | None:
    """The device type `tensor`'s piece must move to before a collective over its mesh, or None where it is."""
    mesh_device = tensor.device_mesh.device_type
    return None if tensor.to_local().device.type == mesh_device else mesh_device


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of `tensor` (a collective over its mesh for a DTensor: every rank of it calls this; a plain
    tensor is returned as it is), on the mesh's device."""
    if not isinstance(tensor, DTensor):
        return tensor
    device = gather_device(tensor)
    return (tensor.to(device) if device else tensor).full_tensor()
