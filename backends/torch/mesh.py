"""DeviceMesh from the plan's resolved MeshSpec."""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from portable_fsdp.plan import MeshSpec


def build_mesh(spec: MeshSpec, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (spec.fsdp_size,), mesh_dim_names=("fsdp",))
