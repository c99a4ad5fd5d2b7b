"""The plan applied to a transformers model with torch_xla, one technique per function, in a fixed order:
gradient checkpointing of each layer, then the FSDP wrap (each unit the wrap policy picks, then the root).

SPMD FSDPv2 (`SpmdFullyShardedDataParallel`) annotates every parameter as sharded over the mesh's fsdp axis and
each unit's output as sharded by row; the XLA compiler inserts the all-gathers and reduce-scatters.
FSDP v1 (`XlaFullyShardedDataParallel`) shards the parameters itself, one process per device.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch_xla
from torch import nn
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module
from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

from portable_fsdp.backends.xla.runtime import Runtime, sequence_axis
from portable_fsdp.plan import ShardingPlan, WrapPolicy


def parallelize(model: nn.Module, plan: ShardingPlan, runtime: Runtime, layer_classes: tuple,
                v1_kwargs: dict) -> nn.Module:
    """Returns the root wrapper; `model` is modified in place (its layers become wrapped units)."""
    if plan.activation_checkpointing:  # the plan folds HF's xla_fsdp_grad_ckpt into it
        apply_gradient_checkpointing(model, layer_classes)
    policy = wrap_policy(model, plan, layer_classes)
    if runtime.spmd:
        return apply_fsdp_v2(model, runtime.mesh, policy)
    return apply_fsdp_v1(model, policy, v1_kwargs)


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
    """Rows of each unit's output over the fsdp axis (the data-parallel half of FSDP), and positions over the
    cp axis when sequences are split. A layer returns a tensor; a transformers model a ModelOutput (or tuple)
    whose first entry is the logits or hidden states, [batch, sequence, ...]."""
    tensor = output if isinstance(output, torch.Tensor) else output[0]
    xs.mark_sharding(tensor, mesh, ("fsdp", sequence_axis(mesh)) + (None,) * (tensor.dim() - 2))


def shard_parameters_over_every_device(model: nn.Module, mesh) -> None:
    """With a cp axis, FSDPv2 alone would shard parameters over fsdp and repeat them over cp; shard each over
    fsdp x cp instead (largest dimension, as FSDPv2 picks), as the torch backend does. FSDPv2 keeps
    shardings already set."""
    for p in model.parameters():
        spec = [None] * p.dim()
        spec[p.shape.index(max(p.shape))] = ("fsdp", "cp")
        xs.mark_sharding(p, mesh, tuple(spec))


def apply_fsdp_v2(model: nn.Module, mesh, policy) -> nn.Module:
    # torch_xla hooks every unit's backward for an optimization barrier; torch warns when a unit's inputs
    # need no gradient (the embedding's token ids), which is expected here.
    for message in ("For backward hooks to be called", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message)
    move_keeping_ties(model, torch_xla.device())
    if sequence_axis(mesh):
        shard_parameters_over_every_device(model, mesh)
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
