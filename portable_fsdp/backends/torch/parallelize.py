"""The plan applied to a torch model: `parallelize` calls one `apply_*` per technique, in a fixed order."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from portable_fsdp.backends.torch.causal_attention import apply_blocked_causal_attention
from portable_fsdp.backends.torch.compile import apply_compile
from portable_fsdp.backends.torch.context_parallel import CPGroup, apply_context_parallel
from portable_fsdp.backends.torch.cpu_collectives import use_cpu_collectives
from portable_fsdp.backends.torch.expert_parallel import apply_expert_parallel, shard_experts
from portable_fsdp.backends.torch.float8 import apply_float8
from portable_fsdp.backends.torch.mesh import Meshes
from portable_fsdp.backends.torch.sequence_parallel import SPGroup, apply_sequence_parallel
from portable_fsdp.backends.torch.tensor_parallel import apply_tensor_parallel
from portable_fsdp.plan import ShardingPlan, WrapPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(model: nn.Module, plan: ShardingPlan, meshes: Meshes, cp: CPGroup | None, sp: SPGroup | None,
                layer_classes: tuple, device_type: str, tp_plan: dict, decide_for: str | None = None) -> bool:
    """Lower `plan` onto `model` in place, in this order, as torchtitan does:

    0. float8 (plan.float8): the chosen Linear layers become torchao's Float8Linear (float8 products);
    1. tensor parallelism (meshes.tp): the modules `tp_plan` names split over the tp group;
    2. expert parallelism (meshes.ep): each MoE layer's experts split over the ep group (tp ranks included), each
       tp rank's share of the tokens sent to them;
    3. context parallelism (`cp`) or Ulysses sequence parallelism (`sp`): attention over the group's
       sequence shards; without either, on cpu, sdpa's causal attention in query blocks that skip the masked keys
       (causal_attention.py);
    4. activation checkpointing (plan.activation_checkpointing): each layer in a CheckpointWrapper;
    5. torch.compile (plan.compile): each layer (its wrapper, when checkpointed) compiled in place;
    6. `fully_shard` of each wrapped unit (a checkpointed layer through its wrapper), then the root, over
       `meshes.dp` (HSDP: replicated over dp_replicate, sharded over fsdp × cp|sp) — unless one rank holds
       everything (`shards`): a world of one rank trains the plain module, moved to the device. On CUDA the
       transformer layers prefetch each other's all-gathers (`explicit_prefetch`).

    `decide_for`: the device whose choices (the attention in blocks, the prefetch) the lowering makes when it is
    not the one it builds on — an estimate for CUDA built on fake CPU tensors; `device_type` by default.

    Returns whether the logits come out sharded over the vocabulary (tensor parallelism's lm_head): the loss
    then runs under torch's loss_parallel."""
    logits_sharded = False
    if plan.float8:
        apply_float8(model)
    if meshes.tp is not None:
        logits_sharded = apply_tensor_parallel(model, meshes.tp, tp_plan, strict=bool(plan.tp_plan))
    experts = apply_expert_parallel(model, meshes.ep, meshes.tp) if meshes.ep is not None else []
    if cp is not None:
        apply_context_parallel(model, cp)
    if sp is not None:
        apply_sequence_parallel(model, sp)
    if cp is None and sp is None and (decide_for or device_type) == "cpu":
        apply_blocked_causal_attention(model)
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model, layer_classes)
    if plan.compile:
        apply_compile([m for m in model.modules() if _class_name(m) in layer_classes and not _inside_wrapper(m, model)])
    if experts:  # sharded over the ranks that hold the same experts, before the layers holding them
        shard_experts(experts, fsdp_kwargs(plan, meshes.expert_dp, device_type),
                      host_collectives=device_type == "cpu" and plan.cpu_collectives == "auto")
    if shards(plan, meshes.world.size(), device_type):
        apply_fsdp(model, plan, meshes, layer_classes, device_type, decide_for)
    else:
        model.to(device_type)
    return logits_sharded


def shards(plan: ShardingPlan, world_size: int, device_type: str) -> bool:
    """Whether FSDP2 wraps the model: on more than one rank, or on one GPU with CPU offload (FSDP2's offload
    policy keeps the state in host memory and brings each unit's parameters to the GPU when it runs). A world
    of one rank otherwise trains the plain module — plain tensors, no hooks, no all-gathers or reduce-scatters;
    its mixed precision is autocast (portable_fsdp/backends/torch/step.py)."""
    return world_size > 1 or (plan.cpu_offload and device_type != "cpu")


def _class_name(module: nn.Module) -> str:
    inner = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
    return type(inner).__name__


def apply_activation_checkpointing(model: nn.Module, layer_classes: tuple) -> None:
    """Wrap every transformer layer so its activations are recomputed in backward."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__ in layer_classes:
                parent.register_module(name, checkpoint_wrapper(child))


def fsdp_kwargs(plan: ShardingPlan, mesh, device_type: str) -> dict:
    mp = plan.mixed_precision
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if plan.cpu_offload else OffloadPolicy()
    return dict(mesh=mesh, reshard_after_forward=plan.reshard_after_forward, offload_policy=offload,
                mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[mp.param_dtype], reduce_dtype=DTYPES[mp.reduce_dtype]))


def explicit_prefetch(plan: ShardingPlan, device_type: str) -> bool:
    """Whether FSDP's units prefetch each other's all-gathers as torchtitan sets them (`unit_overlap`): on CUDA,
    where NCCL runs collectives on streams of their own beside the compute. gloo's collectives block the
    CPU that computes, so there a prefetch only holds a layer's parameters longer. Only with transformer-layer
    units, which run one after another in the order the model holds them. `device_type` is the one the lowering
    runs on, passed in: a test on CPU asks what CUDA would get."""
    return device_type == "cuda" and plan.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP


class UnitOverlap(NamedTuple):
    unit: object
    forward_prefetch: object | None  # the unit whose all-gather this one starts in its forward
    backward_prefetch: object | None  # ... in its backward
    reshard_after_forward: bool


def unit_overlap(units: list, reshard_after_forward: bool, prefetch: bool) -> list:
    """How each FSDP unit of `units` (in the order they run) overlaps its all-gathers with compute. With `prefetch`,
    torchtitan's settings: each unit starts the next one's all-gather in forward and the previous one's in
    backward, and the last keeps its parameters gathered from forward to backward (its backward comes next:
    resharding would gather them again at once). Without, FSDP2's defaults."""
    last = len(units) - 1
    return [UnitOverlap(unit, units[i + 1] if prefetch and i < last else None,
                        units[i - 1] if prefetch and i > 0 else None,
                        reshard_after_forward and not (prefetch and i == last))
            for i, unit in enumerate(units)]


def apply_fsdp(model: nn.Module, plan: ShardingPlan, meshes: Meshes, layer_classes: tuple, device_type: str,
               decide_for: str | None = None) -> None:
    kwargs = fsdp_kwargs(plan, meshes.dp, device_type)
    if plan.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP:
        units = [m for m in model.modules() if _class_name(m) in layer_classes and not _inside_wrapper(m, model)]
    elif plan.auto_wrap_policy == WrapPolicy.SIZE_BASED_WRAP:
        units = _size_based_units(model, plan.min_num_params)
    else:  # NO_WRAP: the root alone (warned about at start-up, portable_fsdp/capabilities.py)
        units = []
    overlap = unit_overlap(units, plan.reshard_after_forward, explicit_prefetch(plan, decide_for or device_type))
    for entry in overlap:
        fully_shard(entry.unit, **{**kwargs, "reshard_after_forward": entry.reshard_after_forward})
    # None = FSDP2's default for the root: kept gathered after forward, as backward needs it at once
    fully_shard(model, **{**kwargs, "reshard_after_forward": None if plan.reshard_after_forward else False})
    for entry in overlap:
        if entry.forward_prefetch is not None:
            entry.unit.set_modules_to_forward_prefetch(_with_inner_units(entry.forward_prefetch))
        if entry.backward_prefetch is not None:
            entry.unit.set_modules_to_backward_prefetch(_with_inner_units(entry.backward_prefetch))
    sum_gradients(model)
    if device_type == "cpu" and meshes.shard.size() > 1 and plan.cpu_collectives == "auto":
        use_cpu_collectives([*units, model], meshes.shard.get_group())


def sum_gradients(model: nn.Module) -> None:
    """Every FSDP unit of `model` sums gradients over its data-parallel ranks instead of averaging them: the loss
    is scaled by 1 / (label tokens of the global batch) before backward, so a sum is the global mean. One rule
    for every unit, whatever mesh it is sharded over (HSDP's replicas included, expert units on a smaller mesh):
    nothing is divided twice. Sums only (no PREMUL_SUM, no AVG), which gloo has."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _with_inner_units(unit: nn.Module) -> list:
    """`unit` and the FSDP units inside it (a MoE layer's experts under expert parallelism): prefetching a layer
    gathers all of it, as torchtitan prefetches a MoE block's experts with the block."""
    return [unit, *(m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule))]


def _inside_wrapper(module: nn.Module, model: nn.Module) -> bool:
    """A layer inside a CheckpointWrapper is sharded through its wrapper (torchtitan's order)."""
    return any(isinstance(m, CheckpointWrapper) and m._checkpoint_wrapped_module is module for m in model.modules())


def _size_based_units(model: nn.Module, min_num_params: int) -> list:
    """Post-order, as torch's size_based_auto_wrap_policy: a module becomes a unit when the parameters it
    holds outside units already chosen below it reach `min_num_params`. Never the root, never a layer
    inside a CheckpointWrapper (the wrapper is the unit), never a container without a forward
    (ModuleList: fully_shard hooks forward), never a module holding a tied parameter (both users of a
    tied weight must stay in one unit: the root)."""
    owners: dict = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    tied = {pid for pid, mods in owners.items() if len(mods) > 1}
    units = []

    def visit(module: nn.Module, wrapped_by_checkpoint: bool) -> int:
        remaining = sum(visit(child, isinstance(module, CheckpointWrapper)) for child in module.children())
        own = list(module.parameters(recurse=False))
        remaining += sum(p.numel() for p in own)
        eligible = (module is not model and not wrapped_by_checkpoint and remaining >= min_num_params
                    and type(module).forward is not nn.Module.forward
                    and not any(id(p) in tied for p in module.parameters()))
        if eligible:
            units.append(module)
            return 0
        return remaining

    visit(model, False)
    return units
