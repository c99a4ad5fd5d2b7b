"""Which mesh sizes must divide which of the model's sizes, checked at start-up once the model is known (its
config read on the meta device): each misfit is one UserError naming the field and a size that works."""
from __future__ import annotations

from portable_fsdp.backend import ModelInfo
from portable_fsdp.errors import UserError
from portable_fsdp.placement import TP_STYLES
from portable_fsdp.plan import MeshSpec, ShardingPlan


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is <= `at_most` (a size that works, for an error message)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def tensor_parallel_plan(plan: ShardingPlan, model: ModelInfo) -> dict:
    """The plan's own tp_plan, or the model's base_model_tp_plan."""
    return dict(plan.tp_plan) or dict(model.tp_plan)


def check_mesh_fits(plan: ShardingPlan, model: ModelInfo) -> None:
    mesh = plan.mesh
    _check_heads(mesh, model, "tp_size", mesh.tp_size, "tensor parallelism splits heads over tp ranks")
    _check_heads(mesh, model, "sp_size", mesh.sp_size,
                 "Ulysses sequence parallelism gives each sp rank whole heads around attention")
    heads_per_tp_rank = model.num_attention_heads // mesh.tp_size
    if mesh.tp_size > 1 and mesh.sp_size > 1 and heads_per_tp_rank % mesh.sp_size:
        raise UserError("plan.sp_size", (
            f"the model's {model.num_attention_heads} attention heads leave {heads_per_tp_rank} per tp rank "
            f"(tp_size={mesh.tp_size}), which sp_size={mesh.sp_size} does not divide (Ulysses gives each sp rank "
            f"whole heads of its tp rank's share); use e.g. plan.sp_size="
            f"{largest_divisor(heads_per_tp_rank, mesh.sp_size)}"))
    if mesh.tp_size > 1:
        _check_tp_plan(plan, model)
    if mesh.ep_size > 1:
        if not model.num_experts:
            raise UserError("plan.ep_size", (
                f"{mesh.ep_size} needs a mixture-of-experts model; {model.root_class or 'this model'} is dense "
                "(no experts to split): set plan.ep_size=1"))
        if model.num_experts % mesh.ep_size:
            # a size that splits the experts and that the mesh takes (a multiple of tp dividing fsdp × tp)
            raise UserError("plan.ep_size", (
                f"{model.num_experts} experts per layer do not split over {mesh.ep_size} ranks; use e.g. "
                f"plan.ep_size={mesh.suggested_ep_size(model.num_experts)}"))


def _check_heads(mesh: MeshSpec, model: ModelInfo, field: str, size: int, why: str) -> None:
    if size <= 1:
        return
    for label, heads in (("attention heads", model.num_attention_heads),
                         ("key/value heads", model.num_key_value_heads)):
        if heads and heads % size:
            working = largest_divisor(model.num_key_value_heads or heads, size)
            raise UserError(f"plan.{field}", (
                f"the model's {heads} {label} are not divisible by {field}={size} ({why}); use e.g. "
                f"plan.{field}={working}"))


def _check_tp_plan(plan: ShardingPlan, model: ModelInfo) -> None:
    tp_plan = tensor_parallel_plan(plan, model)
    if not tp_plan:
        raise UserError("plan.tp_size", (
            f"{plan.mesh.tp_size} needs a tensor-parallel plan and {model.root_class or 'the model'} ships none "
            "(no base_model_tp_plan in its config): give one as plan.tp_plan, e.g. "
            "'{\"layers.*.mlp.up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": \"rowwise\"}', or set "
            "plan.tp_size=1"))
    unknown = sorted({style for style in tp_plan.values() if style not in TP_STYLES})
    if unknown:
        raise UserError("plan.tp_plan", f"unknown style {unknown[0]!r}; choose one of {', '.join(TP_STYLES)}")
