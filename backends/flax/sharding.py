"""The neutral plan lowered to JAX sharding: a Mesh from the MeshSpec, and a PartitionSpec per array.

FSDP in JAX is a placement rule: each parameter (and its optimizer moments) is split along the
shard axes — `fsdp`, and `cp` too when it is larger than 1, as the torch lowering shards over fsdp x cp —
on its largest dimension that they divide, while the batch is split by rows along the data axes.
XLA then gathers a layer's weights where the layer runs and reduce-scatters its gradients.
Tensors under MIN_SHARDED_ELEMENTS (norm scales) are replicated: gathering them would cost more
than the memory it saves.

Context parallelism is the sequence axis of the batch and of the activations split along `cp`. The
program is unchanged — a sharding never changes what XLA computes — so attention over the whole
sequence stays exact: XLA gathers keys and values along `cp` where attention needs them.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from portable_fsdp.plan import MeshSpec

FSDP = "fsdp"
CP = "cp"
DATA_AXES = (FSDP,)  # mesh axes whose devices read different rows of the batch
MIN_SHARDED_ELEMENTS = 1024


def build_mesh(spec: MeshSpec, devices) -> Mesh:
    """Devices laid out (fsdp, cp), cp innermost as in the torch lowering; `spec` is resolved."""
    grid = np.asarray(devices[: spec.fsdp_size * spec.cp_size]).reshape(spec.fsdp_size, spec.cp_size)
    return Mesh(grid, (FSDP, CP))


def shard_axes(mesh: Mesh) -> tuple:
    """The mesh axes parameters are split over: fsdp, and cp too under context parallelism."""
    return (FSDP, CP) if mesh.shape[CP] > 1 else (FSDP,)


def param_spec(shape: tuple, shard_size: int, axes=FSDP) -> PartitionSpec:
    """Shard the largest dimension `shard_size` divides (the first of equals); replicate small tensors."""
    divisible = [d for d in range(len(shape)) if shape[d] % shard_size == 0]
    if math.prod(shape) < MIN_SHARDED_ELEMENTS or not divisible:
        return PartitionSpec(*([None] * len(shape)))
    dim = max(divisible, key=lambda d: (shape[d], -d))
    return PartitionSpec(*(axes if d == dim else None for d in range(len(shape))))


def param_shardings(shapes: dict, mesh: Mesh) -> dict:
    axes = shard_axes(mesh)
    size = math.prod(mesh.shape[a] for a in axes)
    named = axes if len(axes) > 1 else axes[0]  # a spec names one axis as "fsdp", not ("fsdp",)
    return {name: NamedSharding(mesh, param_spec(tuple(s.shape), size, named)) for name, s in shapes.items()}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, leading_axes: int = 0) -> NamedSharding:
    """[..., rows, sequence]: rows over the data axes, the sequence over cp; `leading_axes` unsplit axes
    before the rows (the micro-batch index)."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading_axes), DATA_AXES, CP))


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """Hidden states [b, s, d] stay split by rows (and sequence) between layers, so XLA gathers weights
    (FSDP) rather than splitting activations along the model dimension."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXES, CP, None))


def optimizer_shardings(opt_state_shapes, param_sharding: dict, mesh: Mesh):
    """Moments are sharded like their parameter (found by the parameter's name in the state's path);
    counters and hyperparameters are replicated."""
    def choose(path, _leaf):
        for key in reversed(path):
            name = getattr(key, "key", None)
            if isinstance(name, str) and name in param_sharding:
                return param_sharding[name]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(choose, opt_state_shapes)


def spec_as_json(spec: PartitionSpec) -> list:
    """A PartitionSpec as JSON: one entry per dimension, an axis name, a list of names, or null."""
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def describe(shardings: dict) -> dict:
    """{parameter: its PartitionSpec as JSON} — what the golden sharding files hold."""
    return {name: spec_as_json(s.spec) for name, s in sorted(shardings.items())}
