"""What of the plan torch_xla can honour, decided at start-up: every field without a torch_xla equivalent is a
UserError naming it, never a silent ignore. Imports no framework, so the launcher checks before any compile."""
from __future__ import annotations

from portable_fsdp.errors import UserError
from portable_fsdp.plan import ShardingPlan

V1_DEVICES = ("CPU", "TPU")


def check_plan(plan: ShardingPlan, config, device: str, nproc: int) -> None:
    """`device` is the PJRT device type ("CPU", "TPU", ...); `nproc` the --nproc asked for."""
    v2 = plan.xla.xla_fsdp_v2
    _check_mesh(plan)
    if plan.cpu_offload:
        raise UserError("plan.cpu_offload", (
            "torch_xla's FSDP (SPMD FSDPv2 and XlaFullyShardedDataParallel) cannot keep parameters or optimizer "
            "state in host memory; set plan.cpu_offload=false (or use --backend cpu / cuda for CPU offload)"))
    check_launch(v2, device, nproc)
    if v2:
        _check_spmd(plan, config)
    else:
        _check_v1(plan)


def check_launch(v2: bool, device: str, nproc: int) -> None:
    """Where and how many: checked before the launcher counts devices."""
    if v2:
        return
    if device not in V1_DEVICES:
        raise UserError("plan.xla_fsdp_v2", (
            f"= false (FSDP v1) is launched on {' and '.join(V1_DEVICES)} only, not on PJRT device {device}; "
            "use SPMD FSDPv2 (plan.xla_fsdp_v2=true)"))
    if device == "CPU" and nproc > 1:
        raise UserError("--nproc", (
            f"{nproc}: FSDP v1 (plan.xla_fsdp_v2=false) runs one process per device, and multi-process PJRT CPU "
            "collectives abort in torch_xla 2.9; use --nproc 1 on the CPU, or SPMD FSDPv2 "
            "(plan.xla_fsdp_v2=true) for several CPU devices"))


def _check_mesh(plan: ShardingPlan) -> None:
    """cp_size > 1 is SPMD sequence sharding: the compiler moves K/V, exactly; v1 has nothing like it."""
    if plan.mesh.cp_size == 1:
        return
    if not plan.xla.xla_fsdp_v2:
        raise UserError("plan.cp_size", (
            f"= {plan.mesh.cp_size}: FSDP v1 (XlaFullyShardedDataParallel) cannot split sequences; use SPMD "
            "FSDPv2 (plan.xla_fsdp_v2=true), which shards them over the mesh's cp axis, or set plan.cp_size=1"))
    if plan.cp_impl == "torch":
        raise UserError("plan.cp_impl", (
            "torch's context_parallel needs CUDA SDPA kernels; on --backend xla sequences are split by SPMD "
            "sharding: use plan.cp_impl=auto"))


def ignored_torch_settings(plan: ShardingPlan) -> list:
    """Torch-backend choices of how data travel between ranks (K/V under CP, FSDP's CPU collectives): on
    XLA the compiler makes them. Warned about, not refused: they change speed, never the numbers, and a
    config must run unchanged on either backend."""
    changed = {"plan.cp_rotate_method": plan.mesh.cp_size > 1 and plan.cp_rotate_method != "allgather",
               "plan.cp_load_balance": plan.mesh.cp_size > 1 and not plan.cp_load_balance,
               "plan.cpu_collectives": plan.cpu_collectives != "auto"}
    return [name for name, differs in changed.items() if differs]


def _check_spmd(plan: ShardingPlan, config) -> None:
    if not plan.reshard_after_forward:
        raise UserError("plan.reshard_after_forward", (
            "= false has no SPMD FSDPv2 equivalent: there the XLA compiler decides when gathered parameters are "
            "freed; set it to true, or use FSDP v1 (plan.xla_fsdp_v2=false), which keeps them gathered"))
    mp = plan.mixed_precision
    if mp.param_dtype == "float16":
        raise UserError("plan.param_dtype", (
            "float16 has no SPMD FSDPv2 equivalent: torch_xla's autocast computes in bfloat16; use bfloat16"))
    if mp.reduce_dtype != "float32":
        raise UserError("plan.reduce_dtype", (
            f"{mp.reduce_dtype} has no SPMD FSDPv2 equivalent: the XLA compiler places the gradient reductions "
            "itself; set plan.reduce_dtype=float32, or use FSDP v1 (plan.xla_fsdp_v2=false)"))
    if mp.param_dtype == "bfloat16" and config.model.attn_implementation == "sdpa":
        raise UserError("plan.param_dtype", (
            "bfloat16 under SPMD FSDPv2 is torch_xla's autocast, which does not cover scaled_dot_product_attention "
            "(it would get mixed float32/bfloat16 inputs); set model.attn_implementation=eager, or use FSDP v1 "
            "(plan.xla_fsdp_v2=false), which casts the parameters"))


def _check_v1(plan: ShardingPlan) -> None:
    if plan.cpu_ram_efficient_loading:
        raise UserError("plan.cpu_ram_efficient_loading", (
            "has no FSDP v1 equivalent in torch_xla: every process builds the whole model; set it to false, or "
            "use SPMD FSDPv2 (plan.xla_fsdp_v2=true), where one process per host builds it once"))
    mp = plan.mixed_precision
    if mp.reduce_dtype not in ("float32", mp.param_dtype):
        raise UserError("plan.reduce_dtype", (
            f"{mp.reduce_dtype} with plan.param_dtype={mp.param_dtype}: XlaFullyShardedDataParallel reduces "
            "gradients in the compute dtype or in float32 (fp32_reduce_scatter); set plan.reduce_dtype="
            + " or ".join(sorted({"float32", mp.param_dtype}))))


def activation_checkpointing(plan: ShardingPlan) -> bool:
    """HF's xla_fsdp_grad_ckpt and the plan's activation_checkpointing ask for the same thing."""
    return plan.activation_checkpointing or plan.xla.xla_fsdp_grad_ckpt
