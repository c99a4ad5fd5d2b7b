"""DeviceMeshes from the plan's resolved MeshSpec: FSDP shards over fsdp × cp; cp groups share a batch."""
from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from portable_fsdp.backends.torch.distributed import gloo_banner_hidden
from portable_fsdp.plan import MeshSpec


@dataclasses.dataclass(frozen=True)
class Meshes:
    shard: DeviceMesh  # what fully_shard shards parameters over (and averages gradients over)
    cp: DeviceMesh | None  # this rank's context-parallel group, when cp_size > 1
    dp_rank: int  # which slice of the global batch this rank's group reads
    dp_size: int
    cp_rank: int


def build_meshes(spec: MeshSpec, device_type: str) -> Meshes:
    with gloo_banner_hidden():  # the sub-meshes' groups connect here
        return _build_meshes(spec, device_type)


def _build_meshes(spec: MeshSpec, device_type: str) -> Meshes:
    if spec.cp_size == 1:
        mesh = init_device_mesh(device_type, (spec.fsdp_size,), mesh_dim_names=("fsdp",))
        return Meshes(mesh, None, mesh.get_local_rank("fsdp"), spec.fsdp_size, 0)
    # cp is the inner (fastest-varying) dimension, so a cp group is made of neighbouring ranks.
    mesh = init_device_mesh(device_type, (spec.fsdp_size, spec.cp_size), mesh_dim_names=("fsdp", "cp"))
    shard = mesh["fsdp", "cp"]._flatten("fsdp_cp")
    return Meshes(shard, mesh["cp"], mesh.get_local_rank("fsdp"), spec.fsdp_size, mesh.get_local_rank("cp"))
