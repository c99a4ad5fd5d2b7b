"""Where a parameter lives on the device mesh, decided once for every backend (plain Python: the torch, xla and
flax lowerings ask here, so one plan places each parameter alike on all three).

- The mesh axes, outermost first as portable_fsdp.plan.MeshSpec orders ranks: dp_replicate, fsdp, ep, cp, sp,
  tp. `ep` is the inner part of the plan's fsdp ranks that an ep group spans (fsdp_size = mesh fsdp × ep); a MoE
  layer's experts are split over ep × tp (EXPERT_AXES: plan.ep_size ranks, taken from fsdp × tp as Hugging
  Face takes them).
- The tensor-parallel plan (transformers' base_model_tp_plan notation: `layers.*.self_attn.q_proj: colwise`):
  which parameters it splits over tp, and on which dimension.
- FSDP's dimension under SPMD (xla and flax): the shard axes go on a parameter's largest free dimension they
  divide, and only on a tensor of at least MIN_SHARDED_ELEMENTS. (torch's FSDP2 shards dimension 0 of every
  parameter, padded: a rule of its own.)
"""
from __future__ import annotations

import math

from portable_fsdp.errors import UserError
from portable_fsdp.plan import MeshSpec

DP_REPLICATE, FSDP, EP, CP, SP, TP = "dp_replicate", "fsdp", "ep", "cp", "sp", "tp"
MESH_AXES = (DP_REPLICATE, FSDP, EP, CP, SP, TP)  # outermost first: tp devices are neighbours
DATA_AXES = (DP_REPLICATE, FSDP, EP)  # devices that read different rows of the batch
SEQUENCE_AXES = (CP, SP)  # devices that read different tokens of a row (one of the two is 1)
SHARD_AXES = (FSDP, EP, CP, SP)  # what FSDP splits parameters over (not dp_replicate: HSDP replicas)
EXPERT_AXES = (EP, TP)  # what a MoE layer's expert dimension is split over under expert parallelism


def axis_sizes(mesh: MeshSpec) -> dict:
    """{axis: size} of MESH_AXES, in order, for a resolved MeshSpec."""
    return {DP_REPLICATE: mesh.dp_replicate_size, FSDP: mesh.expert_fsdp_size, EP: mesh.ep_fsdp_size,
            CP: mesh.cp_size, SP: mesh.sp_size, TP: mesh.tp_size}


def expert_axes(mesh: MeshSpec) -> tuple:
    """The axes a MoE layer's experts are split over: EXPERT_AXES under expert parallelism (ep × tp = ep_size
    ranks), none without it (the experts whole on every rank, tp ranks included)."""
    return EXPERT_AXES if mesh.ep_size > 1 else ()


# Styles a tensor-parallel plan may name and what every lowering does with them: split a layer's outputs
# (colwise) or its inputs (rowwise); keep a weight whole on every tp rank (replicated_with_grad_allreduce, and a
# MoE layer's experts: EXPERT_STYLES).
TP_STYLES = ("colwise", "rowwise", "packed_colwise", "replicated_with_grad_allreduce", "moe_tp_experts")
SPLIT_STYLES = ("colwise", "rowwise")
# A MoE layer's experts (the module an expert style names, and every tensor in it; transformers' plans give
# packed_colwise to fused expert tensors only) are never cut by tensor parallelism: expert parallelism
# (plan.ep_size) splits them by expert over ep × tp, tensor parallelism attention and dense MLPs; without
# expert parallelism they stay whole on every tp rank.
EXPERT_STYLES = ("packed_colwise", "moe_tp_experts")


def generic_name(name: str) -> str:
    """`name` with every all-digit atom (a layer index of an nn.ModuleList) as `*`: "layers.3.mlp" ->
    "layers.*.mlp"."""
    return ".".join("*" if atom.isdigit() else atom for atom in name.split("."))


def key_style(tp_plan: dict, name: str) -> str | None:
    """The style the plan's key for `name` (a module or parameter, relative to the base model) gives it.

    transformers' own rule (distributed.parallel_utils._get_parameter_plan): the name's layer indices become
    `*` and the result is looked up as is. So `*` stands for one whole index atom, never for other text (a key
    "layers.*.q_*" names nothing), and a key matches a whole name, not its end."""
    return tp_plan.get(generic_name(name))


def in_experts(tp_plan: dict, name: str) -> bool:
    """Whether `name` is, or lies inside, a module or tensor the plan gives an expert style."""
    atoms = name.split(".")
    return any(key_style(tp_plan, ".".join(atoms[:n])) in EXPERT_STYLES for n in range(1, len(atoms) + 1))


def parameter_style(tp_plan: dict, parameter: str) -> str | None:
    """The style of `parameter` ("layers.0.self_attn.q_proj.weight"): a key naming the parameter itself wins over
    one naming its module (transformers' rule)."""
    own = key_style(tp_plan, parameter)
    return own if own is not None else key_style(tp_plan, parameter.rpartition(".")[0])


def tp_modules(tp_plan: dict, module_names) -> dict:
    """{module name: style} of the modules (outside a MoE layer's experts) a key of the plan names: the layers a
    backend splits or hooks."""
    return {name: style for name in module_names
            if (style := key_style(tp_plan, name)) is not None and not in_experts(tp_plan, name)}


def tp_dim(tp_plan: dict, parameter: str, ndim: int, in_out: bool = False) -> int | None:
    """The dimension of `parameter` (relative to the base model, `ndim` dimensions) the plan splits over tp, or
    None: whole on every tp rank. colwise splits the output features (and a bias), rowwise the input features
    (a bias is added after the sum, whole). A weight is [..., out, in] as nn.Linear keeps it, or [..., in, out]
    when `in_out`: flax kernels, GPT-2's Conv1D, transposed fused experts, and an embedding ([vocab, hidden]: a
    one-hot input of vocab features), which a rowwise split therefore cuts by vocabulary."""
    style = parameter_style(tp_plan, parameter)
    if style not in SPLIT_STYLES or ndim == 0 or in_experts(tp_plan, parameter):
        return None
    if ndim == 1:
        return 0 if style == "colwise" else None
    out_dim, in_dim = (ndim - 1, ndim - 2) if in_out else (ndim - 2, ndim - 1)
    return out_dim if style == "colwise" else in_dim


def check_parameter_keys(tp_plan: dict, parameters) -> None:
    """colwise and rowwise split layers (the torch lowering splits modules, and a split weight needs its layer's
    bias and output split with it): a key naming a parameter (relative to the base model) with one of them is
    refused, unless the parameter is a MoE layer's expert tensor, which stays whole anyway."""
    for name in parameters:
        if key_style(tp_plan, name) in SPLIT_STYLES and not in_experts(tp_plan, name):
            raise UserError("plan.tp_plan", (
                f"{generic_name(name)!r} names a parameter, and colwise and rowwise split whole layers; name its "
                f"module, {generic_name(name.rpartition('.')[0])!r}"))


def unmatched_keys(tp_plan: dict, names) -> list:
    """The plan's keys that name none of `names` (modules and parameters relative to the base model)."""
    generic = {generic_name(name) for name in names}
    return [key for key in tp_plan if key not in generic]


MIN_SHARDED_ELEMENTS = 1024  # smaller tensors (norm scales, small biases) cost more to gather than they save


def fsdp_dim(shape: tuple, shard_size: int, taken=()) -> int | None:
    """The dimension FSDP splits a tensor of `shape` on over `shard_size` devices: the largest dimension not
    `taken` (by tp or ep) that `shard_size` divides, the first of equals. None — the tensor stays whole over the
    shard axes — for a tensor under MIN_SHARDED_ELEMENTS or without such a dimension (JAX refuses an uneven
    split; torch_xla would pad it)."""
    free = [d for d in range(len(shape)) if d not in taken and shape[d] % shard_size == 0]
    if not free or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return None
    return max(free, key=lambda d: (shape[d], -d))


def host_data_slice(host_positions, device_count: int, data_rows: int, row_field: str) -> tuple:
    """(dp_rank, dp_size): which slice of the global batch a host feeds when one process per host drives several
    devices (torch_xla SPMD over a TPU slice, JAX over several machines). `host_positions`: the flat indices, in
    mesh order (MESH_AXES, outermost first), of the `device_count` mesh devices this host drives; `data_rows`: the
    product of the DATA_AXES sizes. The devices that share a batch row (cp × sp × tp of them) are neighbours in
    the mesh, so the host feeds the rows its devices hold: they must be whole rows, in one block aligned to its
    size, as on every host (then the batch is rows dp_rank of dp_size). Otherwise one line naming `row_field`, the
    plan field that made a row span hosts."""
    row_devices = device_count // data_rows
    rows = sorted({position // row_devices for position in host_positions})
    block = len(rows)
    whole = len(set(host_positions)) == block * row_devices
    if not rows or not whole or rows != list(range(rows[0], rows[0] + block)) or rows[0] % block or data_rows % block:
        raise UserError(row_field, (
            f"the devices that share a batch row ({row_devices}: cp x sp x tp) span hosts: each host's devices must "
            f"hold whole rows of the mesh; make cp_size x sp_size x tp_size a divisor of this host's device count "
            f"({len(host_positions)})"))
    return rows[0] // block, data_rows // block
