"""The plan applied to a transformers model with torch_xla, one technique per function, in a fixed order:
tensor parallelism, expert parallelism (tokens dispatched to their experts' devices) and Ulysses sequence
parallelism (annotations of activations), gradient checkpointing of each layer, then the FSDP wrap (each unit the
wrap policy picks, then the root).

SPMD FSDPv2 (`SpmdFullyShardedDataParallel`) runs on one mesh with every axis of the plan: each parameter is
annotated with its partition spec (portable_fsdp/backends/xla/layout.py: over fsdp, and over tp, ep, cp|sp as the plan
says) and each unit's output as sharded by row and position; the XLA compiler inserts the all-gathers,
reduce-scatters, all-reduces and all-to-alls. FSDP v1 (`XlaFullyShardedDataParallel`) shards the parameters
itself, one process per device, over one axis.
"""
from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch_xla
from torch import nn
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module
from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

from portable_fsdp import placement
from portable_fsdp.backend import ModelInfo
from portable_fsdp.backends.xla import layout
from portable_fsdp.backends.xla.expert_dispatch import apply_expert_dispatch
from portable_fsdp.backends.xla.materialize import materialize_sharded
from portable_fsdp.backends.xla.runtime import Runtime
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.plan import ShardingPlan, WrapPolicy


def parallelize(model: nn.Module, plan: ShardingPlan, runtime: Runtime, info: ModelInfo, layer_classes: tuple,
                v1_kwargs: dict, on_meta=None) -> nn.Module:
    """Returns the root wrapper; `model` is modified in place (its layers become wrapped units). Under SPMD,
    `model` may be on the meta device with `on_meta` (hf_torch.deferred_init.OnMeta) to fill it, one parameter at a
    time, as it is sharded."""
    specs = None
    if runtime.spmd:
        tp_plan = tensor_parallel_plan(plan, info) if plan.mesh.tp_size > 1 else {}
        specs = layout.parameter_specs(model, tp_plan, info.num_experts if plan.mesh.ep_size > 1 else 0, plan.mesh)
        apply_tensor_parallel(model, tp_plan, runtime.mesh)
        if plan.mesh.ep_size > 1:
            apply_expert_dispatch(model, runtime.mesh)
        if plan.mesh.sp_size > 1:
            apply_sequence_parallel(model, runtime.mesh)
    if plan.activation_checkpointing:  # the plan folds HF's xla_fsdp_grad_ckpt into it
        apply_gradient_checkpointing(model, layer_classes)
    policy = wrap_policy(model, plan, layer_classes)
    if runtime.spmd:
        return apply_fsdp_v2(model, runtime.mesh, policy, specs, on_meta)
    return apply_fsdp_v1(model, policy, v1_kwargs)


def apply_tensor_parallel(model: nn.Module, tp_plan: dict, mesh) -> None:
    """The outputs of the plan's colwise layers split by feature over tp, those of its rowwise layers whole (the
    Megatron layout: XLA adds a rowwise layer's partial sums over tp), in forward and backward. The weights
    are split in apply_fsdp_v2."""
    base = getattr(model, "base_model", model)  # what the plan's keys are relative to
    modules = dict(base.named_modules())
    for name, style in placement.tp_modules(tp_plan, modules).items():
        modules[name].register_forward_hook(functools.partial(_annotate_output, mesh=mesh, style=style))


def _annotate_output(module, args, output, *, mesh, style):
    spec = layout.tp_output_spec(output.dim(), style) if isinstance(output, torch.Tensor) else None
    return output if spec is None else xs.mark_sharding_with_gradients(output, mesh, spec)


def apply_sequence_parallel(model: nn.Module, mesh) -> None:
    """Ulysses: the model's own attention (its configured implementation and mask), with q/k/v and the
    attention output annotated as split by head over sp, while every other activation is split by position;
    XLA exchanges positions for heads (all-to-all) before attention and back after it. Registered through
    transformers' AttentionInterface under a name of its own, with the same mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation
    name = f"portable_fsdp_ulysses_{base}_{'x'.join(map(str, mesh.mesh_shape))}"
    AttentionInterface.register(name, functools.partial(_head_sharded_attention, base=base, mesh=mesh))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.config._attn_implementation = name


def _head_sharded_attention(module, query, key, value, attention_mask, *, base: str, mesh, **kwargs):
    """transformers' attention signature: q/k/v [rows, heads, positions, dim] in, [rows, positions, heads, dim]
    out (and the weights, None for sdpa)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)  # the family's own
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)
    query, key, value = (xs.mark_sharding_with_gradients(t, mesh, layout.head_sharded_spec(t.dim(), 1))
                         for t in (query, key, value))
    output, weights = attend(module, query, key, value, attention_mask, **kwargs)
    return xs.mark_sharding_with_gradients(output, mesh, layout.head_sharded_spec(output.dim(), 2)), weights


def apply_gradient_checkpointing(model: nn.Module, layer_classes: tuple) -> None:
    """torch_xla's checkpointing of each layer (recomputed in backward behind an optimization barrier, so the
    compiler cannot fold the recomputation back into the saved forward), before any wrap."""
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            checkpoint_module(module)


def wrap_policy(model: nn.Module, plan: ShardingPlan, layer_classes: tuple):
    """torch_xla's auto-wrap policies; None wraps the root only."""
    if plan.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP:
        classes = {type(m) for m in model.modules() if type(m).__name__ in layer_classes}
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
    if plan.auto_wrap_policy == WrapPolicy.SIZE_BASED_WRAP:
        tied = _modules_holding_tied_parameters(model)
        size_based = functools.partial(size_based_auto_wrap_policy, min_num_params=plan.min_num_params)

        def policy(module, recurse, unwrapped_params, **kwargs):
            # Both users of a tied weight must stay in one unit (the root), or v1 would shard two copies.
            return size_based(module, recurse, unwrapped_params, **kwargs) and (recurse or module not in tied)

        return policy
    return None  # NO_WRAP: the root alone (warned about at start-up, portable_fsdp/capabilities.py)


def _modules_holding_tied_parameters(model: nn.Module) -> set:
    owners: dict = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    tied_ids = {pid for pid, modules in owners.items() if len(modules) > 1}
    return {m for m in model.modules() if any(id(p) in tied_ids for p in m.parameters())}


def shard_output(output, mesh) -> None:
    """Rows of each unit's output over the data-parallel ranks (the data-parallel half of FSDP), positions over
    cp|sp. A layer returns a tensor; a transformers model a ModelOutput (or tuple) whose first entry is the
    logits or hidden states, [batch, sequence, ...]."""
    if isinstance(output, torch.Tensor):
        tensor = output
    else:  # a MoE model's output starts with its scalar aux_loss when it returns router logits
        tensor = getattr(output, "logits", None)
        tensor = tensor if tensor is not None else output[0]
    xs.mark_sharding(tensor, mesh, layout.activation_spec(tensor.dim()))


def apply_fsdp_v2(model: nn.Module, mesh, policy, specs: dict, on_meta=None) -> nn.Module:
    """Every parameter annotated with its spec (`specs`, by name) once on the device — or, for a model on the meta
    device, filled from `on_meta` straight into its shards (portable_fsdp/backends/xla/materialize.py); FSDPv2 keeps
    shardings already set, and would otherwise shard over fsdp alone."""
    # torch_xla hooks every unit's backward for an optimization barrier; torch warns when a unit's inputs
    # need no gradient (the embedding's token ids), which is expected here.
    for message in ("For backward hooks to be called", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message)
    if on_meta is not None:
        materialize_sharded(model, on_meta, torch_xla.device(), mesh, specs)
    else:
        move_keeping_ties(model, torch_xla.device())
        for name, param in model.named_parameters():
            xs.mark_sharding(param, mesh, specs[name])
    return SpmdFullyShardedDataParallel(model, mesh=mesh, shard_output=shard_output, auto_wrap_policy=policy)


def move_keeping_ties(model: nn.Module, device) -> None:
    """`Module.to` a device of another tensor type makes a new Parameter per module, so a weight two modules
    share (tied embeddings) would become two; link every user back to one. SpmdFullyShardedDataParallel's
    own move is then a no-op."""
    users = [(module, name, id(p)) for module in model.modules() for name, p in module._parameters.items()
             if p is not None]
    model.to(device)
    moved: dict = {}
    for module, name, original in users:
        module._parameters[name] = moved.setdefault(original, module._parameters[name])


def apply_fsdp_v1(model: nn.Module, policy, kwargs: dict) -> nn.Module:
    return XlaFullyShardedDataParallel(model, auto_wrap_policy=policy, **kwargs)
