"""The neutral plan lowered to JAX sharding: one Mesh from the MeshSpec, and a PartitionSpec per array.

The mesh has every axis of the plan, outermost first (portable_fsdp.placement.MESH_AXES): dp_replicate, fsdp,
ep, cp, sp, tp — `ep` being the inner part of the fsdp ranks an ep group spans (fsdp_size = mesh fsdp × ep, ep =
plan.ep_size / tp_size), so every rank keeps
the coordinates portable_fsdp.plan gives it. What each axis does is only where arrays are placed; a sharding never
changes what XLA computes, so every combination computes what one device would:

- FSDP is a placement rule: each parameter (and its AdamW moments) is split along the shard axes — fsdp and ep,
  and cp or sp too when they are larger than 1, as the torch lowering shards over them — on its largest
  dimension that they divide (portable_fsdp.placement.fsdp_dim, the rule every backend shares). XLA gathers a
  layer's weights where the layer runs and reduce-scatters its gradients. Tensors under
  placement.MIN_SHARDED_ELEMENTS (norm scales) are not split: gathering them costs more than the memory it
  saves.
- HSDP: parameters are not split over dp_replicate (a replica of the sharded model per dp_replicate index);
  the batch's rows are split over dp_replicate × fsdp × ep, so gradients are reduced over all of them.
- TP: the model's tensor-parallel plan (transformers' notation, `layers.*.self_attn.q_proj: colwise`) names the
  parameters to split over `tp` (portable_fsdp.placement.tp_dim): colwise ones on their output dimension,
  rowwise ones on their input dimension, with fsdp on another dimension (2-D sharding); tp never cuts a MoE
  layer's experts, as on every backend. XLA all-reduces the rowwise outputs.
- EP: a MoE layer's expert weights are split on the expert dimension over `ep` × `tp` (the plan's ep_size
  ranks, taken from fsdp × tp as Hugging Face takes them); the layer runs under shard_map (moe.py), its tokens
  sent to their experts' devices and back by all-to-all.
- CP and Ulysses SP: the batch's sequence is split over `cp` or `sp`. Under SP, q/k/v inside attention are
  constrained to be split by heads over sp (`Layout.heads`) instead: XLA emits the all-to-alls that exchange
  sequence for heads and back. Under CP, XLA gathers keys and values along `cp` where attention needs them.

Specs name only the axes larger than 1, so a plan's placements read as what it splits (the golden files).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from portable_fsdp import placement
from portable_fsdp.errors import UserError
from portable_fsdp.placement import DATA_AXES, FSDP, SEQUENCE_AXES, SHARD_AXES, SP, TP
from portable_fsdp.plan import MeshSpec

EXPERTS = ".experts."  # a MoE layer's expert weights carry this in their name; their first dimension is the expert
BASE_MODEL = "model."  # the prefix of the base model's parameters: tp-plan keys are relative to it


def build_mesh(spec: MeshSpec, devices) -> Mesh:
    """The devices laid out as the plan's axes, tp innermost; `spec` is resolved."""
    sizes = placement.axis_sizes(spec)
    grid = np.asarray(devices[: math.prod(sizes.values())]).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))


def split_over(mesh: Mesh, axes) -> tuple:
    """The axes of `axes` the mesh really splits over (size above 1)."""
    return tuple(a for a in axes if mesh.shape[a] > 1)


def entry(axes: tuple):
    """One PartitionSpec entry: None, an axis name, or a tuple of them."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def size_of(mesh: Mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def param_spec(shape: tuple, shard_size: int, axes=FSDP, fixed: dict | None = None) -> PartitionSpec:
    """`fixed` dimensions (dim -> entry: tp, ep) as given; `axes` (of `shard_size` devices) on the dimension
    placement.fsdp_dim picks (small tensors, or none it divides: only their fixed dimensions)."""
    fixed = {d % len(shape): e for d, e in (fixed or {}).items()} if shape else {}
    spec = [fixed.get(d) for d in range(len(shape))]
    target = placement.fsdp_dim(shape, shard_size, fixed) if shard_size > 1 else None
    if target is not None:
        spec[target] = axes
    return PartitionSpec(*spec)


def tp_dim(torch_name: str, ndim: int, tp_plan: dict) -> int | None:
    """The dimension of a flax parameter the plan splits over tp (placement.tp_dim): kernels are [..., in, out]
    (torch's Linear is [out, in]), an embedding [vocab, hidden], fused experts [experts, ..., in, out]."""
    if not torch_name.startswith(BASE_MODEL):
        return None  # the output projection: outside the base model the keys are relative to
    return placement.tp_dim(tp_plan, torch_name.removeprefix(BASE_MODEL), ndim, in_out=True)


def param_shardings(shapes: dict, mesh: Mesh, tp_plan: dict | None = None, torch_name=lambda n: n,
                    expert_axes: tuple = ()) -> dict:
    """{flax name: NamedSharding}. `torch_name` maps a flax name to the transformers name the tp plan's
    patterns are written against; `expert_axes` (placement.expert_axes: the mesh alone cannot tell ep = tp
    from tp without ep) split a MoE layer's experts."""
    tp_plan = (tp_plan or {}) if mesh.shape[TP] > 1 else {}
    placement.check_parameter_keys(tp_plan, [n.removeprefix(BASE_MODEL) for n in map(torch_name, shapes)
                                             if n.startswith(BASE_MODEL)])
    placed = {name: NamedSharding(mesh, _spec(name, tuple(s.shape), mesh, tp_plan, torch_name, expert_axes))
              for name, s in shapes.items()}
    if mesh.shape[TP] > 1 and not any(TP in str(s.spec) for s in placed.values()):
        raise UserError("plan.tp_plan", (
            f"names none of the model's parameters ({', '.join(sorted(tp_plan)) or 'it is empty'}), so "
            f"plan.tp_size={mesh.shape[TP]} would split nothing; write patterns like 'layers.*.self_attn.q_proj'"))
    return placed


def _spec(name: str, shape: tuple, mesh: Mesh, tp_plan: dict, torch_name, expert_axes: tuple) -> PartitionSpec:
    fixed = {}
    shard_axes = split_over(mesh, SHARD_AXES)
    if EXPERTS in name and expert_axes:
        fixed[0] = entry(split_over(mesh, expert_axes))
        shard_axes = tuple(a for a in shard_axes if a not in expert_axes)
    dim = tp_dim(torch_name(name), len(shape), tp_plan)
    if dim is not None:
        if shape[dim] % mesh.shape[TP]:
            raise UserError("plan.tp_size", (
                f"{mesh.shape[TP]} does not divide {torch_name(name)}'s dimension {dim} ({shape[dim]}), which "
                "plan.tp_plan splits; use a tp_size that divides it, or leave it out of plan.tp_plan"))
        fixed[dim] = TP
    return param_spec(shape, size_of(mesh, shard_axes), entry(shard_axes), fixed)


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array on the devices as `sharding` splits it. Each process copies only its own devices' shards
    (with several processes, every one holds the same full value)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_all(host_params: dict, shardings: dict) -> dict:
    return {name: place(value, shardings[name]) for name, value in host_params.items()}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def rows(mesh: Mesh):
    return entry(split_over(mesh, DATA_AXES))


def sequence(mesh: Mesh):
    return entry(split_over(mesh, SEQUENCE_AXES))


def batch_sharding(mesh: Mesh, leading_axes: int = 0) -> NamedSharding:
    """[..., rows, sequence]: rows over the data axes, the sequence over cp or sp; `leading_axes` unsplit axes
    before the rows (the micro-batch index)."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading_axes), rows(mesh), sequence(mesh)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the model's activations are placed inside the compiled program (model.py calls these; outside a
    mesh each is the identity): hidden states between layers and q/k/v inside attention. `expert_axes`: what a
    MoE layer's experts are split over (placement.expert_axes), for the layer's shard_map (moe.py); `platform`: the
    devices the program is for when they are not the mesh's (a memory estimate for a GPU or TPU on host devices),
    whose grouped matmul the MoE layers trace.
    """

    mesh: Mesh | None = None
    expert_axes: tuple = ()
    platform: str | None = None

    def _constrain(self, x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def hidden(self, h):
        """[b, s, d]: rows and sequence split, whole over tp."""
        return h if self.mesh is None else self._constrain(h, rows(self.mesh), sequence(self.mesh), None)

    def tokens(self, x):
        """[b, s, ...] around attention under Ulysses SP — q/k/v as the projections make them, attention's output
        before o_proj — split by sequence like the layer's input, so the projections run on each device's tokens
        and the exchange of sequence for heads is an all-to-all (not a gather of the activations, nor a
        reduction of o_proj's outputs). The other dimensions are as the weights split them (tp)."""
        if self.mesh is None or self.mesh.shape[SP] == 1:
            return x
        free = [PartitionSpec.UNCONSTRAINED] * (x.ndim - 2)
        return self._constrain(x, rows(self.mesh), sequence(self.mesh), *free)

    def heads(self, x):
        """q/k/v [b, s, heads, head_dim]. Under Ulysses SP the whole sequence, heads split over sp (inside each
        tp rank's heads): the all-to-all from the sequence split. Otherwise left as the projections made it."""
        if self.mesh is None or self.mesh.shape[SP] == 1:
            return x
        return self._constrain(x, rows(self.mesh), None, entry(split_over(self.mesh, (TP, SP))), None)


def optimizer_shardings(opt_state_shapes, param_shapes: dict, param_sharding: dict, mesh: Mesh):
    """Moments are sharded like their parameter (found by the parameter's name in the state's path); counters,
    hyperparameters and statistics of another shape (Adafactor's row and column means, small) are replicated."""
    def choose(path, leaf):
        for key in reversed(path):
            name = getattr(key, "key", None)
            if isinstance(name, str) and name in param_sharding:
                same_shape = leaf.shape == param_shapes[name].shape
                return param_sharding[name] if same_shape else replicated(mesh)
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(choose, opt_state_shapes)


def spec_as_json(spec: PartitionSpec) -> list:
    """A PartitionSpec as JSON: one entry per dimension, an axis name, a list of names, or null."""
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def describe(shardings: dict) -> dict:
    """{parameter: its PartitionSpec as JSON} — what the golden sharding files hold."""
    return {name: spec_as_json(s.spec) for name, s in sorted(shardings.items())}
