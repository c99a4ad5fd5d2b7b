"""A MoE layer's routed experts in fixed-size blocks: only the routed (token, expert) pairs are computed, with static
shapes, so XLA compiles one graph whatever the routing.

The N·K (token, expert) pairs are placed by expert into blocks of `rows` slots, each block holding one expert's
pairs (an expert's last block padded with empty slots); each block multiplies its rows by its expert's weights (one
batched matmul per projection), and the results, scaled by the router weights, are added back into their tokens.
The shapes are those of the bounds in portable_fsdp/routed_blocks.py (blocks past the experts' own are empty).
Nothing is dropped (no capacity factor): a step is that of the model's own experts.

Expert parallelism (portable_fsdp/backends/xla/expert_dispatch.py) adds two leading dimensions: `sources`, the
token shards (each routes its own tokens), and `groups`, equal parts of consecutive experts — blocks
[sources, groups, blocks, rows], the blocks of group g holding only the pairs of group g's experts, each group
sized for its own worst case (every token of the source sending it all the pairs it can).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from portable_fsdp import routed_blocks

MAX_BLOCK_ROWS = 128  # a block's rows: large enough for an efficient matmul on a TPU's systolic array


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static layout of one MoE layer's blocks: `tokens` tokens per source with `top_k` experts each."""
    tokens: int
    top_k: int
    experts: int
    groups: int = 1
    sources: int = 1

    @property
    def rows(self) -> int:
        return routed_blocks.block_rows(self.tokens * self.top_k, self.experts, MAX_BLOCK_ROWS)

    @property
    def experts_per_group(self) -> int:
        return self.experts // self.groups

    @property
    def blocks_per_group(self) -> int:
        pairs = routed_blocks.capacity(self.tokens, self.top_k, self.experts_per_group)
        return routed_blocks.block_count(pairs, self.experts_per_group, self.rows)

    @property
    def slots(self) -> int:
        """Rows per source the experts' matmuls run on: its routed pairs and the empty slots of the bound."""
        return self.groups * self.blocks_per_group * self.rows

    @property
    def blocks(self) -> tuple:
        return self.sources, self.groups, self.blocks_per_group, self.rows


@dataclasses.dataclass(frozen=True)
class Routing:
    """Per source: the pair in each slot (`pair`, [sources, slots]; `tokens·top_k` for an empty slot), its token
    (`token`, the last token for an empty slot: its result weighs 0), and the expert of each block within its group
    (`expert`, [sources, groups, blocks_per_group])."""
    pair: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor


def route(top_k_index: torch.Tensor, shape: Shape) -> Routing:
    """Places each source's pairs: computed from counts and prefix sums (no sort, no data-dependent shape)."""
    with torch.no_grad():
        experts = top_k_index.reshape(shape.sources, -1)
        pairs = experts.shape[1]
        device = experts.device
        one_hot = (experts[..., None] == torch.arange(shape.experts, device=device)).long()
        rank = ((one_hot.cumsum(1) - 1) * one_hot).sum(2)  # the pair's place among its expert's pairs
        blocks = (one_hot.sum(1) + shape.rows - 1) // shape.rows  # [sources, experts]
        ends = blocks.view(shape.sources, shape.groups, shape.experts_per_group).cumsum(2)  # within each group
        first = (ends - blocks.view_as(ends)).view(shape.sources, 1, shape.experts)
        group = torch.div(experts, shape.experts_per_group, rounding_mode="floor")
        slot = (group * shape.blocks_per_group + (one_hot * first).sum(2)) * shape.rows + rank
        pair = torch.full((shape.sources, shape.slots), pairs, dtype=torch.long, device=device)
        pair = pair.scatter(1, slot, torch.arange(pairs, device=device).expand_as(slot))
        token = torch.div(pair, shape.top_k, rounding_mode="floor").clamp(max=shape.tokens - 1)
        block = torch.arange(shape.blocks_per_group, device=device)
        expert = (block[:, None] >= ends[:, :, None, :]).sum(-1).clamp(max=shape.experts_per_group - 1)
    return Routing(pair, token, expert)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`source` [sources, n, ...] rows picked per source by `index` [sources, m]: [sources, m, ...]."""
    flat = index + torch.arange(index.shape[0], device=index.device)[:, None] * source.shape[1]
    return source.flatten(0, 1)[flat.reshape(-1)].view(*index.shape, *source.shape[2:])


def add_rows(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """The transpose of gather_rows: `values` [sources, m, ...] added into rows `index` [sources, m] of zeros
    [sources, rows, ...]."""
    flat = index + torch.arange(index.shape[0], device=index.device)[:, None] * rows
    total = values.new_zeros(index.shape[0] * rows, *values.shape[2:])
    return total.index_add(0, flat.reshape(-1), values.flatten(0, 1)).view(index.shape[0], rows, *values.shape[2:])


def slot_weights(top_k_weights: torch.Tensor, routing: Routing, shape: Shape, gather=gather_rows) -> torch.Tensor:
    """Each slot's router weight [sources, slots, 1] (0 in empty slots)."""
    weights = F.pad(top_k_weights.reshape(shape.sources, -1, 1), (0, 0, 0, 1))  # the empty slots' 0
    return gather(weights, routing.pair)


def run_blocks(module, states: torch.Tensor, pick) -> torch.Tensor:
    """The experts of `module` (transformers' fused experts: gate_up_proj / up_proj, down_proj, optional biases,
    transposed or not, gated or not, optional post-expert norm) on blocks `states` [..., rows, hidden];
    `pick(parameter)` gives each block its expert's slice of a [experts, ...] parameter, [..., *slice]."""
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    out = _block_linear(module, states, up_name, pick)
    out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
    out = _block_linear(module, out, "down_proj", pick)
    return module.post_expert_norm(out) if module.has_post_expert_norm else out


def _block_linear(module, states: torch.Tensor, name: str, pick) -> torch.Tensor:
    weight = pick(getattr(module, name))  # [..., out, in], or [..., in, out] when transposed
    out = torch.matmul(states, weight if module.is_transposed else weight.transpose(-1, -2))
    return out + pick(getattr(module, f"{name}_bias")).unsqueeze(-2) if module.has_bias else out


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature (hidden [tokens, hidden], top-k expert ids and weights [tokens, top_k]):
    one source, one group."""
    shape = Shape(hidden_states.shape[0], top_k_index.shape[-1], module.num_experts)
    routing = route(top_k_index, shape)
    states = gather_rows(hidden_states[None], routing.token).view(*shape.blocks, -1)
    expert = routing.expert.view(-1)
    results = run_blocks(module, states, lambda p: p[expert].view(*shape.blocks[:3], *p.shape[1:]))
    weighted = results.reshape(1, shape.slots, -1) * slot_weights(top_k_weights, routing, shape)
    return add_rows(weighted, routing.token, shape.tokens)[0].to(hidden_states.dtype)
