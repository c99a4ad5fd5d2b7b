"""Expert parallelism on the SPMD mesh: tokens go to the devices holding their experts, the experts' weights stay.

Under expert parallelism a fused expert weight [experts, ...] has its expert dimension split over ep × tp
(portable_fsdp/backends/xla/layout.py): `groups` = ep_size parts of consecutive experts, part g on the devices of
ep × tp coordinate g. Every device (a source) routes its own share of the tokens into blocks
[sources, groups, blocks, rows] (expert_blocks.py), picking its tokens' states on its own devices (a
manual-sharding region: the partitioner would otherwise gather every device's tokens). The blocks are then
annotated as split over ep × tp by group: the partitioner sends each group's blocks to its experts' devices
(all-to-all), each device multiplies them by its own experts' weights — indexed on the device, in a manual-sharding
region too (an index into weights split by expert would make the partitioner gather them) —, and the results go
back to their sources the same way, where each adds them into its tokens, again on its own devices. The only
collectives on expert weights are FSDP's: a group's experts gathered over the devices that share the group, their
gradients summed over them.

The shapes are static, so each group is sized for its worst case: all of a source's pairs going to that group's
experts. The blocks computed are then up to `groups` times the routed pairs (expert_blocks.Shape per group), the
price of static shapes.
"""
from __future__ import annotations

import functools
import math

import torch
import torch_xla.distributed.spmd as xs

from portable_fsdp.backends.hf_torch import experts
from portable_fsdp.backends.xla import expert_blocks, layout
from portable_fsdp.placement import EXPERT_AXES, MESH_AXES

# Every device dispatches its own tokens: its share of the rows and positions it holds, split further over tp (the
# tp devices hold the same tokens; each sends 1/tp of them, and the results are gathered back over tp).
SOURCE_AXES = MESH_AXES
# [groups, sources, blocks, rows, features] at the experts: groups over ep x tp, sources over what is left. Groups
# lead, so that the matmuls' batch (groups, sources and blocks merged) stays split.
AT_EXPERTS = (EXPERT_AXES, tuple(a for a in SOURCE_AXES if a not in EXPERT_AXES), None, None, None)
_GROUP_SPEC = (EXPERT_AXES,)  # [groups, ...]: one group per ep x tp coordinate, whole over the other axes


def apply_expert_dispatch(model: torch.nn.Module, mesh) -> None:
    """Run `model`'s experts with token dispatch over `mesh` (registered through transformers' ExpertsInterface
    under a name of its own)."""
    from transformers.integrations.moe import ExpertsInterface

    name = f"portable_fsdp_expert_dispatch_{'x'.join(map(str, mesh.mesh_shape))}"
    ExpertsInterface.register(name, functools.partial(dispatching_forward, mesh=mesh))
    experts.set_implementation(model, name)


def dispatching_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *, mesh) -> torch.Tensor:
    sizes = mesh.shape()
    sources, groups = (math.prod(sizes[a] for a in axes) for axes in (SOURCE_AXES, EXPERT_AXES))
    layout.check_expert_tokens(hidden_states.shape[0], sources)  # checked at start-up for the run's own batches
    shape = expert_blocks.Shape(hidden_states.shape[0] // sources, top_k_index.shape[-1], module.num_experts,
                                groups, sources)
    routing = expert_blocks.route(top_k_index, shape)

    def per_source(values, index, rows=None):
        return _PerSource.apply(values, index, mesh, rows)

    states = per_source(hidden_states.view(sources, shape.tokens, -1), routing.token)
    states = xs.mark_sharding_with_gradients(states.view(*shape.blocks, -1).transpose(0, 1), mesh, AT_EXPERTS)
    expert = routing.expert.transpose(0, 1)  # [groups, sources, blocks]: within the group

    def pick(parameter: torch.Tensor) -> torch.Tensor:
        by_group = parameter.view(groups, shape.experts_per_group, *parameter.shape[1:])
        return _PickExperts.apply(by_group, expert, mesh)

    results = xs.mark_sharding_with_gradients(expert_blocks.run_blocks(module, states, pick), mesh, AT_EXPERTS)
    weights = expert_blocks.slot_weights(top_k_weights, routing, shape, gather=per_source)
    weighted = results.transpose(0, 1).reshape(sources, shape.slots, -1) * weights
    return per_source(weighted, routing.token, shape.tokens).view_as(hidden_states).to(hidden_states.dtype)


class _PerSource(torch.autograd.Function):
    """On each source's own devices (a manual-sharding region over SOURCE_AXES): expert_blocks.gather_rows of
    `values` [sources, n, ...] by `index` [sources, m], or with `rows`, its transpose add_rows into that many rows."""

    @staticmethod
    def forward(ctx, values, index, mesh, rows=None):
        ctx.save_for_backward(index)
        ctx.mesh, ctx.rows, ctx.values_rows = mesh, rows, values.shape[1]
        return _on_sources(values, index, mesh, rows)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        transposed = ctx.values_rows if ctx.rows is None else None
        return _on_sources(grad.contiguous(), index, ctx.mesh, transposed), None, None, None


def _on_sources(values: torch.Tensor, index: torch.Tensor, mesh, rows: int | None) -> torch.Tensor:
    local_values, local_index = _manual(values, (SOURCE_AXES,), mesh), _manual(index, (SOURCE_AXES,), mesh)
    local = expert_blocks.gather_rows(local_values, local_index) if rows is None \
        else expert_blocks.add_rows(local_values, local_index, rows)
    return _full(local, (SOURCE_AXES,), (values.shape[0], *local.shape[1:]), mesh)


class _PickExperts(torch.autograd.Function):
    """Each block's expert weights [groups, sources, blocks, ...] from `by_group` [groups, experts of a group, ...],
    indexed on each group's own devices (a manual-sharding region), so no weight leaves them. Backward adds each
    device's blocks' gradients into its experts and the partitioner sums them over the devices sharing a group."""

    @staticmethod
    def forward(ctx, by_group, expert, mesh):
        ctx.save_for_backward(expert)
        ctx.mesh, ctx.shape = mesh, by_group.shape
        weights = _manual(by_group, _GROUP_SPEC, mesh)[0]
        local = _manual(expert, AT_EXPERTS[:3], mesh)
        picked = weights[local.flatten(0, 2)].view(*local.shape, *weights.shape[1:])
        return _full(picked, AT_EXPERTS[:3], (*expert.shape, *by_group.shape[2:]), mesh)

    @staticmethod
    def backward(ctx, grad):
        (expert,) = ctx.saved_tensors
        local = _manual(expert, AT_EXPERTS[:3], ctx.mesh)
        blocks = _manual(grad.contiguous(), AT_EXPERTS[:3], ctx.mesh)
        partial = blocks.new_zeros(ctx.shape[1:]).index_add(0, local.flatten(0, 2), blocks.flatten(0, 2))
        # [groups, the devices sharing a group, experts of a group, ...], summed over the sharing devices
        sharing = math.prod(ctx.mesh.shape()[a] for a in AT_EXPERTS[1])
        partials = _full(partial[None, None], AT_EXPERTS[:2], (ctx.shape[0], sharing, *ctx.shape[1:]), ctx.mesh)
        return partials.sum(1), None, None


def _manual(tensor: torch.Tensor, spec: tuple, mesh) -> torch.Tensor:
    """Each device's block of `tensor` split by `spec` (trailing dimensions whole), for code that runs per device."""
    spec = spec + (None,) * (tensor.dim() - len(spec))
    return xs.enable_manual_sharding(tensor, spec, mesh=mesh).global_tensor


def _full(local: torch.Tensor, spec: tuple, shape: tuple, mesh) -> torch.Tensor:
    """The `shape` tensor whose blocks by `spec` are the devices' `local` ones: back under the partitioner."""
    spec = spec + (None,) * (local.dim() - len(spec))
    return xs.disable_manual_sharding(local, spec, shape, mesh=mesh).global_tensor
