"""Where every tensor lives on the xla backend's one SPMD mesh, as partition specs (plain Python: importing
this module imports no torch_xla, so the rules are unit-tested in milliseconds).

The mesh has an axis for every axis of the plan, outermost first as portable_fsdp.plan.MeshSpec orders them:
dp_replicate, fsdp, ep, cp, sp, tp. MeshSpec carves the expert ranks out of the fsdp ranks (fsdp = outer × ep,
ep inner), so here the plan's fsdp ranks are the two axes `fsdp` × `ep` (SPMD FSDPv2 wants an axis named
fsdp: it is the outer part). An axis of size 1 stays in the mesh: a spec naming it splits nothing, so the same
specs serve every plan and a plain fsdp run keeps the layouts it always had.

- A batch [rows, positions] has its rows over dp_replicate × fsdp × ep (the data-parallel ranks) and its
  positions over cp or sp (whichever splits sequences); every activation between layers likewise.
- A parameter is spread over every device of a replica (fsdp, ep, cp, sp, tp) and repeated over dp_replicate
  (HSDP). A weight the tensor-parallel plan names has its output features (colwise) or input features
  (rowwise) over tp; under expert parallelism an expert weight has its expert dimension over ep; the axes
  left go on the largest remaining dimension, as FSDPv2 itself picks.
- Ulysses sequence parallelism: around attention, q/k/v and the attention output are split by head over sp
  (and tp) instead of by position; XLA turns the change of layout into all-to-alls.

XLA inserts every collective these layouts need; the model code is transformers' own.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from portable_fsdp.errors import UserError
from portable_fsdp.plan import MeshSpec

if TYPE_CHECKING:
    from torch import nn

MESH_AXES = ("dp_replicate", "fsdp", "ep", "cp", "sp", "tp")
ROWS = ("dp_replicate", "fsdp", "ep")  # the data-parallel ranks: each holds different rows
POSITIONS = ("cp", "sp")  # the ranks a sequence is split over (one of the two is 1)
PARAMETER_AXES = ("fsdp", "ep", "cp", "sp", "tp")  # every device of one replica
HEADS = ("tp", "sp")  # attention heads under Ulysses sequence parallelism (with tensor parallelism, tp-major)

COLWISE = ("colwise", "packed_colwise")  # the output features over tp
ROWWISE = ("rowwise",)  # the input features over tp (a bias stays whole)


def mesh_shape(mesh: MeshSpec) -> tuple:
    """The size of each of MESH_AXES for a resolved MeshSpec."""
    return (mesh.dp_replicate_size, mesh.fsdp_size // mesh.ep_size, mesh.ep_size, mesh.cp_size, mesh.sp_size,
            mesh.tp_size)


def activation_spec(ndim: int) -> tuple:
    """[rows, positions, ...features]: rows over the data-parallel ranks, positions over cp|sp."""
    return (ROWS, POSITIONS) + (None,) * (ndim - 2)


def tp_output_spec(ndim: int, style: str) -> tuple | None:
    """A tensor-parallel linear's output [rows, positions, ..., features]: the features split over tp after a
    colwise layer, whole after a rowwise one (its partial sums are added over tp). None: no annotation."""
    if ndim < 3 or style not in COLWISE + ROWWISE:
        return None
    return activation_spec(ndim)[:-1] + ("tp" if style in COLWISE else None,)


def head_sharded_spec(ndim: int, head_dim: int) -> tuple:
    """q/k/v [rows, heads, positions, dim] or the attention output [rows, positions, heads, dim] under Ulysses
    sequence parallelism: whole sequences, heads split over HEADS."""
    spec = [ROWS] + [None] * (ndim - 1)
    spec[head_dim] = HEADS
    return tuple(spec)


def _pattern(key: str) -> re.Pattern:
    """A tp-plan key ("layers.*.self_attn.q_proj", relative to the base model) as a regex over full names:
    `*` is a layer index, and the key matches the end of a name at a dot."""
    return re.compile(r"(?:.*\.)?" + re.escape(key).replace(r"\*", r"\d+"))


def tp_style(tp_plan: dict, parameter: str) -> str | None:
    """The style the plan gives `parameter` ("model.layers.0.self_attn.q_proj.weight"): a key naming the
    parameter itself wins over one naming its module."""
    module = parameter.rpartition(".")[0]
    for name in (parameter, module):
        for key, style in tp_plan.items():
            if _pattern(key).fullmatch(name):
                return style
    return None


def tp_modules(tp_plan: dict, module_names) -> dict:
    """{module name: style} of the modules a key of the plan names (their outputs are annotated)."""
    patterns = [(_pattern(key), style) for key, style in tp_plan.items()]
    return {name: style for name in module_names for pattern, style in patterns if pattern.fullmatch(name)}


def tp_dim(style: str | None, ndim: int, transposed: bool = False) -> int | None:
    """The dimension of a weight that `style` splits over tp: the output features of a colwise weight, the
    input features of a rowwise one (None for a rowwise bias and for styles that keep a weight whole).
    Weights are [..., out, in] as nn.Linear keeps them, or [..., in, out] when `transposed` (GPT-2's Conv1D,
    transposed fused experts)."""
    if ndim == 0 or style not in COLWISE + ROWWISE:
        return None
    if ndim == 1:
        return 0 if style in COLWISE else None
    out_dim, in_dim = (ndim - 1, ndim - 2) if transposed else (ndim - 2, ndim - 1)
    return out_dim if style in COLWISE else in_dim


def parameter_spec(shape: tuple, tp_dim: int | None = None, expert: bool = False) -> tuple:
    """The partition spec of a parameter of `shape`: dimension 0 over ep for an expert weight, `tp_dim` over tp,
    and the rest of PARAMETER_AXES on the largest dimension left (the first of equals) — or, when none is
    left, after tp on `tp_dim`."""
    if not shape:
        return ()
    axes = [[] for _ in shape]
    rest = list(PARAMETER_AXES)
    if expert:
        axes[0].append("ep")
        rest.remove("ep")
    if tp_dim is not None:
        axes[tp_dim].append("tp")
        rest.remove("tp")
    free = [d for d in range(len(shape)) if not axes[d]]
    target = max(free, key=lambda d: (shape[d], -d)) if free else (tp_dim if tp_dim is not None else 0)
    axes[target].extend(rest)
    return tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes)


def is_expert_weight(parameter: str, shape: tuple, num_experts: int) -> bool:
    """A fused expert weight of a MoE layer (transformers keeps each layer's experts as tensors [experts, ...]
    in a module named `experts`: Mixtral's gate_up_proj and down_proj)."""
    module = parameter.rpartition(".")[0]
    return bool(num_experts) and module.rpartition(".")[2] == "experts" and len(shape) >= 2 \
        and shape[0] == num_experts


def parameter_specs(model: nn.Module, tp_plan: dict, num_experts: int) -> dict:
    """{parameter name: partition spec} (parameter_spec) of every parameter of the unwrapped model (read, never
    moved: a model on the meta device will do);
    `num_experts` is 0 unless expert parallelism splits the experts. A tensor-parallel plan that names no
    parameter, or expert parallelism that finds no expert weight, is a UserError rather than a run that
    silently shards like plain FSDP."""
    modules = dict(model.named_modules())
    specs, split, experts = {}, [], []
    for name, param in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        transposed = type(owner).__name__ == "Conv1D" or bool(getattr(owner, "is_transposed", False))
        dim = tp_dim(tp_style(tp_plan, name), param.dim(), transposed)
        expert = is_expert_weight(name, tuple(param.shape), num_experts)
        specs[name] = parameter_spec(tuple(param.shape), dim, expert)
        split += [name] if dim is not None else []
        experts += [name] if expert else []
    if tp_plan and not split:
        raise UserError("plan.tp_plan", (
            f"names no weight of the model ({', '.join(list(tp_plan)[:3])}, ...); keys are module names relative "
            f"to the base model with * for a layer index, e.g. 'layers.*.mlp.up_proj' (the model's weights look "
            f"like {', '.join(list(specs)[:3])})"))
    if num_experts and not experts:
        raise UserError("plan.ep_size", (
            "found no fused expert weights ([experts, ...] tensors in a module named experts) to split over ep "
            "ranks; set plan.ep_size=1"))
    return specs
