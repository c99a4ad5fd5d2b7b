"""One DeviceMesh for the whole plan, and the named sub-meshes each technique works on (torchtitan's ParallelDims).

The world is dp_replicate × fsdp × cp|sp × tp, outermost first (portable_fsdp.plan.MeshSpec), so tp ranks are
neighbours. The mesh has a dimension for every axis larger than 1, and always one for fsdp (FSDP shards over
it even when it is 1). With expert parallelism a MoE layer's experts live on a mesh of their own over the same
ranks (`expert_meshes`): split over ep — ep_size / tp_size of the fsdp ranks times the tp ranks, as Hugging
Face's DistributedConfig lays out its (efsdp, ep) mesh — and sharded over efsdp, the fsdp ranks left.

FSDP shards parameters over fsdp × cp|sp (every rank of a sequence group holds different tokens, so their
gradients add up), and under HSDP replicates those shards over dp_replicate.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from portable_fsdp.backends.torch.distributed import gloo_banner_hidden
from portable_fsdp.plan import MeshSpec


@dataclasses.dataclass(frozen=True)
class Meshes:
    world: DeviceMesh  # every axis above 1 (and fsdp), outermost first
    dp: DeviceMesh  # what fully_shard gets: `shard`, or (dp_replicate, shard) under HSDP
    shard: DeviceMesh  # the 1-D mesh parameters are sharded over: fsdp × cp|sp
    replicate: DeviceMesh | None  # HSDP: the replicas of each shard
    cp: DeviceMesh | None  # this rank's context-parallel group
    sp: DeviceMesh | None  # this rank's Ulysses sequence-parallel group
    tp: DeviceMesh | None  # this rank's tensor-parallel group
    ep: DeviceMesh | None  # the ranks a MoE layer's experts are split over (inner part of fsdp × tp)
    expert_dp: DeviceMesh | None  # what fully_shard gets for expert weights: efsdp × cp|sp (× dp_replicate)
    spec: MeshSpec
    rank: int

    @property
    def coordinates(self) -> dict:
        return self.spec.coordinates(self.rank)

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads."""
        return self.spec.data_parallel_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.spec.data_parallel_size

    @property
    def cp_rank(self) -> int:
        return self.coordinates["cp"]

    @property
    def sp_rank(self) -> int:
        return self.coordinates["sp"]

    @property
    def batch_group_size(self) -> int:
        """Ranks that read the same rows (a cp|sp group times a tp group): neighbours in rank order."""
        return self.spec.sequence_size * self.spec.tp_size

    @property
    def leads_batch_group(self) -> bool:
        """The one rank of its cp|sp × tp group that counts label tokens and tp-replicated loss sums."""
        coords = self.coordinates
        return coords["cp"] == coords["sp"] == coords["tp"] == 0


def build_meshes(spec: MeshSpec, device_type: str) -> Meshes:
    with gloo_banner_hidden():  # the sub-meshes' groups connect here
        return _build_meshes(spec, device_type)


def mesh_dims(spec: MeshSpec) -> list:
    """(name, size) of the world mesh's dimensions, outermost first."""
    return [(name, size) for name, size in spec.axes() if name == "fsdp" or size > 1]


def _build_meshes(spec: MeshSpec, device_type: str) -> Meshes:
    dims = mesh_dims(spec)
    names = [name for name, _ in dims]
    world = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(names))
    sub = lambda name: world[name] if name in names else None  # noqa: E731
    sequence = [name for name in ("cp", "sp") if name in names]
    shard = _flat(world, ["fsdp"] + sequence, "dp_shard")
    replicate = sub("dp_replicate")
    dp = world["dp_replicate", shard.mesh_dim_names[0]] if replicate is not None else shard
    ep, expert_dp = expert_meshes(spec, device_type) if spec.ep_size > 1 else (None, None)
    return Meshes(world=world, dp=dp, shard=shard, replicate=replicate, cp=sub("cp"), sp=sub("sp"), tp=sub("tp"),
                  ep=ep, expert_dp=expert_dp, spec=spec, rank=dist.get_rank())


def expert_meshes(spec: MeshSpec, device_type: str) -> tuple:
    """(ep, expert_dp) on a mesh of their own, the world's ranks reordered so that ep is its last dimension:
    (dp_replicate, efsdp, cp|sp, ep), dimensions of size 1 left out but efsdp's and ep's. An ep group is
    ep_size / tp_size neighbouring fsdp ranks (the inner part of fsdp) times their tp ranks: ep rank
    = fsdp part × tp_size + tp rank, Hugging Face's layout (transformers distributed/utils.py,
    initialize_distributed_mesh: efsdp × ep over the ranks of fsdp × tp). FSDP2 composes a weight's ep sharding
    with its own only over a root mesh where the expert-shard dimensions come before ep, in order; in the
    world's order (efsdp, ep part, cp|sp, tp) cp|sp lies inside the ep group."""
    # the world in rank order, fsdp split in two: (dp_replicate, efsdp, ep part, sequence, tp)
    world = (spec.dp_replicate_size, spec.expert_fsdp_size, spec.ep_fsdp_size, spec.sequence_size, spec.tp_size)
    ranks = torch.arange(math.prod(world)).view(*world).permute(0, 1, 3, 2, 4)  # the ep part beside tp: ep = both
    sizes = {"dp_replicate": spec.dp_replicate_size, "efsdp": spec.expert_fsdp_size,
             "sequence": spec.sequence_size, "ep": spec.ep_size}
    dims = [(name, size) for name, size in sizes.items() if size > 1 or name in ("efsdp", "ep")]
    mesh = DeviceMesh(device_type, ranks.reshape(*(size for _, size in dims)),
                      mesh_dim_names=tuple(name for name, _ in dims))
    names = [name for name, _ in dims]
    expert_shard = _flat(mesh, [n for n in ("efsdp", "sequence") if n in names], "expert_shard")
    if "dp_replicate" in names:
        return mesh["ep"], mesh["dp_replicate", expert_shard.mesh_dim_names[0]]
    return mesh["ep"], expert_shard


def _flat(world: DeviceMesh, names: list, flat_name: str) -> DeviceMesh:
    """The 1-D mesh over `names` (in order), registered in `world` as `flat_name`."""
    if len(names) == 1:
        return world[names[0]]
    return world[tuple(names)]._flatten(flat_name)
