"""Expert parallelism on the SPMD mesh: tokens go to the devices holding their experts, the experts' weights stay.

Under expert parallelism a fused expert weight [experts, ...] has its expert dimension split over ep × tp
(portable_fsdp/backends/xla/layout.py): `groups` = ep_size parts of consecutive experts, part g on the devices of
ep × tp coordinate g. The routed pairs are laid out in blocks [groups, blocks, rows] (expert_blocks.py: the blocks
of group g hold only the pairs of group g's experts), and that layout is annotated as split over ep × tp like the
weights: the partitioner then moves the token blocks to their experts' devices and the results back (all-to-all),
and each device multiplies its blocks by its own experts' weights, picked by a one-hot product over its local
experts (a dot whose batch dimension is the group, so it stays on the device; a gather by expert id would make the
partitioner fetch the weights). The only gathers of expert weights left are FSDP's, over the devices that share a
group (fsdp × cp × sp).

The shapes are static, so each group is sized for its worst case: all of a token's pairs going to that group's
experts. The blocks computed are then up to `groups` times the routed pairs (the bound of expert_blocks.Shape per
group), in exchange for moving tokens instead of weights.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import torch_xla.distributed.spmd as xs

from portable_fsdp.backends.hf_torch import experts
from portable_fsdp.backends.xla import expert_blocks
from portable_fsdp.placement import DATA_AXES, EXPERT_AXES, SEQUENCE_AXES

BLOCKS_SPEC = (EXPERT_AXES, None, None, None)  # [groups, blocks, rows, features]: groups over ep x tp
TOKENS_SPEC = (DATA_AXES + SEQUENCE_AXES, None)  # [rows x positions, features], as between layers


def apply_expert_dispatch(model: torch.nn.Module, mesh) -> None:
    """Run `model`'s experts with token dispatch over `mesh` (registered through transformers' ExpertsInterface
    under a name of its own)."""
    from transformers.integrations.moe import ExpertsInterface

    groups = 1
    for axis in EXPERT_AXES:
        groups *= mesh.shape()[axis]
    name = f"portable_fsdp_expert_dispatch_{'x'.join(map(str, mesh.mesh_shape))}"
    ExpertsInterface.register(name, functools.partial(dispatching_forward, mesh=mesh, groups=groups))
    experts.set_implementation(model, name)


def dispatching_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *, mesh, groups: int) -> torch.Tensor:
    shape = expert_blocks.Shape(hidden_states.shape[0], top_k_index.shape[-1], module.num_experts, groups)
    routing = expert_blocks.route(top_k_index, shape)
    hidden_states = xs.mark_sharding_with_gradients(hidden_states, mesh, TOKENS_SPEC)
    states = xs.mark_sharding_with_gradients(expert_blocks.gather_tokens(hidden_states, routing, shape), mesh,
                                             BLOCKS_SPEC)
    local = F.one_hot(routing.expert, shape.experts_per_group)  # [groups, blocks, experts of the group]

    def pick(parameter: torch.Tensor) -> torch.Tensor:
        by_group = parameter.view(groups, shape.experts_per_group, *parameter.shape[1:])
        return torch.einsum("gbe,ge...->gb...", local.to(parameter.dtype), by_group)

    results = xs.mark_sharding_with_gradients(expert_blocks.run_blocks(module, states, pick), mesh, BLOCKS_SPEC)
    combined = expert_blocks.scatter_results(results, top_k_weights, routing, shape).to(hidden_states.dtype)
    return xs.mark_sharding_with_gradients(combined, mesh, TOKENS_SPEC)
