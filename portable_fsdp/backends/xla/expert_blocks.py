"""A MoE layer's routed experts in fixed-size blocks: only the routed (token, expert) pairs are computed, with static
shapes, so XLA compiles one graph whatever the routing.

The N·K (token, expert) pairs are placed by expert into blocks of `rows` slots, each block holding one expert's
pairs (an expert's last block padded with empty slots); each block multiplies its rows by its expert's weights (one
batched matmul per projection), and the results, scaled by the router weights, are added back into their tokens.
Every block count is bounded before any routing is known: an expert with c pairs fills ceil(c / rows) blocks, so
all experts together fill at most (pairs + experts·(rows − 1)) / rows — the shapes are those of that bound, and
blocks past the experts' own are empty. Nothing is dropped (no capacity factor): a step is that of the model's own
experts.

With `groups` > 1 (expert parallelism: portable_fsdp/backends/xla/expert_dispatch.py) the experts are split into
`groups` equal, consecutive parts and the blocks are laid out [groups, blocks, rows]: the blocks of group g hold
only the pairs of group g's experts, each group bounded by its own worst case (every token sending it all the pairs
it can).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

MAX_BLOCK_ROWS = 128  # a block's rows: large enough for an efficient matmul on a TPU's systolic array
PADDING_SHARE = 4  # rows are chosen so that empty slots stay under 1/PADDING_SHARE of the pairs


def block_rows(pairs: int, experts: int) -> int:
    """The rows of a block: the largest power of two (at most MAX_BLOCK_ROWS) whose padding, at most rows − 1 empty
    slots per expert, stays under a PADDING_SHARE-th of the pairs."""
    fitting = max(1, pairs // (PADDING_SHARE * experts))
    return min(MAX_BLOCK_ROWS, 1 << (fitting.bit_length() - 1))


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static layout of one MoE layer's blocks for `tokens` tokens with `top_k` experts each."""
    tokens: int
    top_k: int
    experts: int
    groups: int = 1

    @property
    def rows(self) -> int:
        return block_rows(self.tokens * self.top_k, self.experts)

    @property
    def experts_per_group(self) -> int:
        return self.experts // self.groups

    @property
    def blocks_per_group(self) -> int:
        # A token sends a group at most min(top_k, its experts) pairs (its top-k experts are distinct).
        pairs = self.tokens * min(self.top_k, self.experts_per_group)
        return max(1, (pairs + self.experts_per_group * (self.rows - 1)) // self.rows)

    @property
    def slots(self) -> int:
        """Rows the experts' matmuls run on: the routed pairs and the empty slots of the bound."""
        return self.groups * self.blocks_per_group * self.rows


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each slot's pair comes from (`pair`, [slots]; `tokens·top_k` for an empty slot) and the expert of each
    block within its group (`expert`, [groups, blocks_per_group])."""
    pair: torch.Tensor
    expert: torch.Tensor


def route(top_k_index: torch.Tensor, shape: Shape) -> Routing:
    """Places the pairs: computed from counts and prefix sums (no sort, no data-dependent shape)."""
    with torch.no_grad():
        experts = top_k_index.reshape(-1)
        pairs = experts.numel()
        one_hot = (experts[:, None] == torch.arange(shape.experts, device=experts.device)).long()
        rank = ((one_hot.cumsum(0) - 1) * one_hot).sum(1)  # the pair's place among its expert's pairs
        blocks = (one_hot.sum(0) + shape.rows - 1) // shape.rows  # per expert
        ends = blocks.view(shape.groups, shape.experts_per_group).cumsum(1)  # within each group
        first = (ends - blocks.view_as(ends)).view(-1)
        group = torch.div(experts, shape.experts_per_group, rounding_mode="floor")
        slot = (group * shape.blocks_per_group + first[experts]) * shape.rows + rank
        pair = torch.full((shape.slots,), pairs, dtype=torch.long, device=experts.device)
        pair = pair.scatter(0, slot, torch.arange(pairs, device=experts.device))
        block = torch.arange(shape.blocks_per_group, device=experts.device)
        expert = (block[None, :, None] >= ends[:, None, :]).sum(-1).clamp(max=shape.experts_per_group - 1)
    return Routing(pair, expert)


def gather_tokens(hidden: torch.Tensor, routing: Routing, shape: Shape) -> torch.Tensor:
    """The slots' token states [groups, blocks, rows, hidden] (an empty slot holds the last token's: its result
    weighs 0)."""
    return hidden[_slot_tokens(routing, shape)].view(shape.groups, shape.blocks_per_group, shape.rows, -1)


def scatter_results(results: torch.Tensor, top_k_weights: torch.Tensor, routing: Routing,
                    shape: Shape) -> torch.Tensor:
    """Each token's sum of its pairs' results times their router weights, [tokens, hidden] (results' dtype)."""
    results = results.reshape(shape.slots, -1)
    weights = F.pad(top_k_weights.reshape(-1), (0, 1))[routing.pair]  # empty slots weigh 0
    weighted = results * weights[:, None]
    return weighted.new_zeros(shape.tokens, weighted.shape[-1]).index_add(0, _slot_tokens(routing, shape), weighted)


def _slot_tokens(routing: Routing, shape: Shape) -> torch.Tensor:
    # No padding row for empty slots: [tokens, ...] tensors keep a shape the devices divide evenly.
    return torch.div(routing.pair, shape.top_k, rounding_mode="floor").clamp(max=shape.tokens - 1)


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
    """transformers' experts signature (hidden [tokens, hidden], top-k expert ids and weights [tokens, top_k]),
    every block in one group."""
    shape = Shape(hidden_states.shape[0], top_k_index.shape[-1], module.num_experts)
    routing = route(top_k_index, shape)
    expert = routing.expert.view(-1)
    results = run_blocks(module, gather_tokens(hidden_states, routing, shape),
                         lambda p: p[expert].view(1, shape.blocks_per_group, *p.shape[1:]))
    return scatter_results(results, top_k_weights, routing, shape).to(hidden_states.dtype)
