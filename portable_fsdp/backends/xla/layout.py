"""Where every tensor lives on the xla backend's one SPMD mesh, as partition specs (plain Python: importing
this module imports no torch_xla, so the rules are unit-tested in milliseconds).

The mesh has an axis for every axis of the plan, outermost first (portable_fsdp.placement.MESH_AXES):
dp_replicate, fsdp, ep, cp, sp, tp, the plan's fsdp ranks being the two axes `fsdp` × `ep` (SPMD FSDPv2 wants
an axis named fsdp: it is the outer part; `ep` is the part of fsdp an ep group spans, ep_size / tp_size). An
axis of size 1 stays in the mesh: a spec naming it splits nothing, so the same specs serve every plan.

- A batch [rows, positions] has its rows over dp_replicate × fsdp × ep (the data-parallel ranks) and its
  positions over cp or sp (whichever splits sequences); every activation between layers likewise.
- A parameter is spread over every device of a replica (fsdp, ep, cp, sp, tp) and repeated over dp_replicate
  (HSDP). A weight the tensor-parallel plan splits has its output features (colwise) or input features
  (rowwise) over tp; under expert parallelism an expert weight has its expert dimension over ep × tp (the
  plan's ep_size ranks, taken from fsdp × tp as Hugging Face takes them); the axes
  left go on the largest remaining dimension they divide, and a tensor too small to be worth it stays whole
  (portable_fsdp.placement: the rules every backend shares).
- Ulysses sequence parallelism: around attention, q/k/v and the attention output are split by head over sp
  (and tp) instead of by position; XLA turns the change of layout into all-to-alls.

XLA inserts every collective these layouts need; the model code is transformers' own.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from portable_fsdp import placement
from portable_fsdp.errors import UserError
from portable_fsdp.placement import DATA_AXES, EXPERT_AXES, SEQUENCE_AXES, SHARD_AXES, TP
from portable_fsdp.plan import MeshSpec

if TYPE_CHECKING:
    from torch import nn

PARAMETER_AXES = SHARD_AXES + (TP,)  # every device of one replica: FSDPv2 stores parameters over tp too
HEADS = ("tp", "sp")  # attention heads under Ulysses sequence parallelism (with tensor parallelism, tp-major)


def mesh_shape(mesh: MeshSpec) -> tuple:
    """The size of each of placement.MESH_AXES for a resolved MeshSpec."""
    return tuple(placement.axis_sizes(mesh).values())


def activation_spec(ndim: int) -> tuple:
    """[rows, positions, ...features]: rows over the data-parallel ranks, positions over cp|sp."""
    return (DATA_AXES, SEQUENCE_AXES) + (None,) * (ndim - 2)


def tp_output_spec(ndim: int, style: str) -> tuple | None:
    """A tensor-parallel linear's output [rows, positions, ..., features]: the features split over tp after a
    colwise layer, whole after a rowwise one (its partial sums are added over tp). None: no annotation."""
    if ndim < 3 or style not in placement.SPLIT_STYLES:
        return None
    return activation_spec(ndim)[:-1] + ("tp" if style == "colwise" else None,)


def head_sharded_spec(ndim: int, head_dim: int) -> tuple:
    """q/k/v [rows, heads, positions, dim] or the attention output [rows, positions, heads, dim] under Ulysses
    sequence parallelism: whole sequences, heads split over HEADS."""
    spec = [DATA_AXES] + [None] * (ndim - 1)
    spec[head_dim] = HEADS
    return tuple(spec)


def parameter_spec(shape: tuple, sizes: dict, tp_dim: int | None = None, expert: bool = False) -> tuple:
    """The partition spec of a parameter of `shape` on a mesh of `sizes` ({axis: size}): dimension 0 over ep × tp
    (EXPERT_AXES) for an expert weight, `tp_dim` over tp, and the rest of PARAMETER_AXES on the dimension
    placement.fsdp_dim picks (none: the parameter is whole over them)."""
    axes = [[] for _ in shape]
    rest = list(PARAMETER_AXES)
    if expert:
        axes[0].extend(EXPERT_AXES)
        rest = [a for a in rest if a not in EXPERT_AXES]
    if tp_dim is not None:
        axes[tp_dim].append("tp")
        rest.remove("tp")
    taken = [d for d in range(len(shape)) if axes[d]]
    target = placement.fsdp_dim(shape, math.prod(sizes[a] for a in rest), taken)
    if target is not None:
        axes[target].extend(rest)
    return tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes)


def is_expert_weight(parameter: str, shape: tuple, num_experts: int) -> bool:
    """A fused expert weight of a MoE layer (transformers keeps each layer's experts as tensors [experts, ...]
    in a module named `experts`: Mixtral's gate_up_proj and down_proj)."""
    module = parameter.rpartition(".")[0]
    return bool(num_experts) and module.rpartition(".")[2] == "experts" and len(shape) >= 2 \
        and shape[0] == num_experts


def parameter_specs(model: nn.Module, tp_plan: dict, num_experts: int, mesh: MeshSpec) -> dict:
    """{parameter name: partition spec} (parameter_spec) of every parameter of the unwrapped model (read, never
    moved: a model on the meta device will do) on the resolved `mesh`;
    `num_experts` is 0 unless expert parallelism splits the experts. A tensor-parallel plan that names no
    parameter, or expert parallelism that finds no expert weight, is a UserError rather than a run that
    silently shards like plain FSDP."""
    from torch import nn

    modules = dict(model.named_modules())
    in_base = base_model_names(model)
    relative = {name: base_name for name, _ in model.named_parameters() if (base_name := in_base(name)) is not None}
    placement.check_parameter_keys(tp_plan, relative.values())
    sizes = placement.axis_sizes(mesh)
    specs, split, experts = {}, [], []
    for name, param in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        # [..., in, out] weights: an embedding [vocab, hidden], GPT-2's Conv1D, transposed fused experts
        in_out = isinstance(owner, nn.Embedding) or type(owner).__name__ == "Conv1D" \
            or bool(getattr(owner, "is_transposed", False))
        dim = placement.tp_dim(tp_plan, relative[name], param.dim(), in_out) if name in relative else None
        expert = is_expert_weight(name, tuple(param.shape), num_experts)
        specs[name] = parameter_spec(tuple(param.shape), sizes, dim, expert)
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


MICRO_BATCH_ROWS = "train.batch_size / train.grad_accum_steps"


def check_expert_tokens(tokens: int, devices: int, rows_field: str = MICRO_BATCH_ROWS) -> None:
    """Under ep every device dispatches its own share of a batch's `tokens` (expert_dispatch.py): the share must
    be whole. `rows_field`: what sets the batch's rows, for the fix."""
    if tokens % devices:
        raise UserError("plan.ep_size", (
            f"expert parallelism sends each device's share of a batch's {tokens} tokens (rows x positions) to the "
            f"experts' devices: they must divide by the {devices} devices; make {rows_field} x data.seq_len a "
            f"multiple of {devices}, or set plan.ep_size=1"))


def check_expert_batches(config, devices: int) -> None:
    """check_expert_tokens for the run's training micro-batches and eval batches, before any worker starts."""
    t = config.train
    check_expert_tokens(t.batch_size // t.grad_accum_steps * config.data.seq_len, devices)
    check_expert_tokens(t.eval_batch_size * config.data.seq_len, devices, "train.eval_batch_size")


def base_model_names(model: nn.Module):
    """A function from a name in `model` to the name relative to its base model (transformers' `base_model`,
    what tp-plan keys are written against), or None for a name outside it (the output projection)."""
    base = getattr(model, "base_model", model)
    if base is model:
        return lambda name: name
    prefix = next(name for name, module in model.named_modules() if module is base) + "."
    return lambda name: name.removeprefix(prefix) if name.startswith(prefix) else None
