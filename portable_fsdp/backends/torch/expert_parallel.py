"""Expert parallelism (plan.ep_size) for transformers' mixture-of-experts models, under FSDP2.

transformers keeps a MoE layer's experts fused in one module (Mixtral, Qwen3-MoE, ...: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]), called as `experts(hidden [N, H], top_k_index [N, K], top_k_weights [N, K])`
after the router chose K experts per token. Under expert parallelism each rank of an ep group holds E/ep of
them — a DTensor `Shard(0)` over the ep mesh, so a checkpoint still sees the full [E, ...] weight — and the
module's forward becomes:

0. with tensor parallelism, the ep group holds whole tp groups, whose ranks hold the same tokens (replicated
   activations): each tp rank takes its 1/tp of them (`_SliceTokens`), so no token is sent twice;
1. this rank's (token, expert) pairs, sorted by expert, each go to the rank holding its expert: one
   `all_to_all_single` with uneven splits (the counts per expert are exchanged first);
2. the received rows, sorted by expert, run through the local experts: one grouped matrix product per projection
   where torch has the kernel, else one per expert that received rows (portable_fsdp/backends/torch/local_experts.py);
3. the results take the reverse route, and each token's K results are summed with its router weights;
4. with tensor parallelism, the tp group's slices are all-gathered back into every token (`_GatherTokens`).

Steps 0 and 4 are Megatron's conjugate pair: slicing forward is an all-gather backward, all-gathering forward a
slice backward (the gradient arriving is the same on every tp rank, as the activation it belongs to).

Every pair is computed — no capacity, no dropped token — so a step is the step of one process. The all-to-alls
are autograd functions: backward sends each gradient back along its pair's route.

`shard_experts` then hands each rank's experts to FSDP over `expert_dp`, the ranks that hold the same experts
(the fsdp ranks outside the ep group, × cp|sp; replicated over dp_replicate under HSDP), never over the ep group
(nor its tp ranks) again; the rest of each layer is sharded over every fsdp rank as usual
(portable_fsdp/backends/torch/parallelize.py).
"""
from __future__ import annotations

import dataclasses
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from portable_fsdp.backends.hf_torch.experts import expert_modules
from portable_fsdp.backends.torch import local_experts
from portable_fsdp.backends.torch.cpu_collectives import use_cpu_collectives
from portable_fsdp.errors import UserError

WEIGHTS = ("gate_up_proj", "down_proj")


def apply_expert_parallel(model: nn.Module, ep_mesh, tp_mesh=None) -> list:
    """Split every MoE layer's experts over `ep_mesh` (in place, before FSDP) and make their forward dispatch
    tokens to the ranks holding their experts; returns the experts modules. `tp_mesh`: this rank's tp group
    (inside its ep group), whose ranks hold the same tokens and each dispatch a slice of them."""
    experts = expert_modules(model)
    if not experts:
        raise UserError("plan.ep_size", (
            f"{type(model).__name__} keeps no fused experts module (transformers' gate_up_proj / down_proj) that "
            "expert parallelism can split; set plan.ep_size=1"))
    for module in experts:
        _check_layout(module)
    for module in experts:
        for name in WEIGHTS:
            weight = getattr(module, name)
            # Every rank holds the full weight (or a meta one, under rank-0 loading): each keeps its own slice.
            shard = distribute_tensor(weight.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=weight.requires_grad))
        module._ep_group = ep_mesh.get_group()
        module._tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        module.forward = types.MethodType(_tp_sliced_forward, module)
    return experts


def _check_layout(module: nn.Module) -> None:
    """The layout the local computation implements: concatenated [gate; up] rows, no biases, weights stored
    [out, in], no norm after the experts (Mixtral, Qwen3-MoE, ...)."""
    plain = (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
             and not getattr(module, "has_bias", True) and not getattr(module, "is_transposed", True)
             and not getattr(module, "has_post_expert_norm", True)
             and all(isinstance(getattr(module, n, None), nn.Parameter) for n in WEIGHTS))
    if not plain:
        raise UserError("plan.ep_size", (
            f"{type(module).__name__} stores its experts in a layout expert parallelism does not split yet (it "
            "splits fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases); set plan.ep_size=1"))


def _tp_sliced_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under expert parallelism: each tp rank dispatches its slice of the tokens the tp
    group shares, and the slices' results are gathered back to every tp rank."""
    group = self._tp_group
    if group is None:
        return _dispatching_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens = hidden_states.shape[0]
    rows = _own_rows(tokens, group)
    sliced = _dispatching_forward(self, _SliceTokens.apply(hidden_states, group), top_k_index[rows],
                                  _SliceTokens.apply(top_k_weights, group))
    return _GatherTokens.apply(sliced, group, tokens)


def _own_rows(tokens: int, group) -> slice:
    """This rank's rows of `tokens` split over `group`: ceil(tokens / size) each, the last ones shorter or empty."""
    per_rank = -(-tokens // group.size())
    start = min(dist.get_rank(group) * per_rank, tokens)
    return slice(start, min(start + per_rank, tokens))


def _gather_rows(part: torch.Tensor, group, tokens: int) -> torch.Tensor:
    """Every rank's rows (`_own_rows`) of a tensor of `tokens` rows, in rank order: one all-gather of equal,
    zero-padded pieces (uneven pieces are what gloo's all-gather lacks)."""
    per_rank = -(-tokens // group.size())
    padded = F.pad(part, (0, 0) * (part.dim() - 1) + (0, per_rank - part.shape[0])).contiguous()
    gathered = padded.new_empty((per_rank * group.size(), *part.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered[:tokens]


class _SliceTokens(torch.autograd.Function):
    """This tp rank's rows of a tensor every rank of the group holds alike; backward gathers the rows' gradients."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.tokens = group, full.shape[0]
        return full[_own_rows(full.shape[0], group)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad.contiguous(), ctx.group, ctx.tokens), None


class _GatherTokens(torch.autograd.Function):
    """Every tp rank's rows, gathered; backward keeps this rank's rows of the gradient, which is the same on
    every rank of the group."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group, tokens: int) -> torch.Tensor:
        ctx.group = group
        return _gather_rows(part, group, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[_own_rows(grad.shape[0], ctx.group)], None, None


def _dispatching_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ep group's exchange of this rank's tokens (the module's own signature and result)."""
    group = self._ep_group
    ranks, num_tokens, top_k = group.size(), top_k_index.shape[0], top_k_index.shape[1]
    local = self.num_experts // ranks
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # pairs grouped by expert, so by the rank holding it
    sent, received = route_counts(expert_ids, self.num_experts, group)
    send_splits = [sum(sent[r * local:(r + 1) * local]) for r in range(ranks)]
    receive_splits = [sum(row) for row in received]
    rows = _exchange(hidden_states[order // top_k], receive_splits, send_splits, group)
    # Rows arrive by source rank, then by local expert: put each local expert's rows together.
    local_ids = torch.arange(local, device=rows.device).repeat(ranks)
    flat = torch.tensor([n for row in received for n in row], device=rows.device)
    by_expert = torch.argsort(torch.repeat_interleave(local_ids, flat, output_size=rows.shape[0]), stable=True)
    outputs = _local_experts(self, rows[by_expert], [sum(column) for column in zip(*received)])
    returned = _exchange(outputs[_inverse(by_expert)], send_splits, receive_splits, group)
    per_pair = returned[_inverse(order)].view(num_tokens, top_k, -1)
    # As transformers' implementations: router weights applied per pair, the K results summed, then the dtype.
    return (per_pair * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)


def route_counts(expert_ids: torch.Tensor, num_experts: int, group) -> tuple:
    """(sent, received) as Python lists: how many of this rank's (token, expert) pairs go to each expert, and
    [source rank][local expert] how many pairs each rank of `group` sends to this rank's experts (one all-to-all
    of the counts). The memory estimate replaces it with balanced routing (fake tensors hold no ids to count)."""
    ranks = group.size()
    with torch.no_grad():
        sent = torch.bincount(expert_ids, minlength=num_experts)
        received = torch.empty_like(sent)  # [source rank, local expert], flattened
        dist.all_to_all_single(received, sent, group=group)
    return sent.tolist(), received.view(ranks, num_experts // ranks).tolist()


def _exchange(rows: torch.Tensor, receive_splits: list, send_splits: list, group) -> torch.Tensor:
    """Autograd-aware all-to-all of `rows` over `group`: send_splits[r] rows go to rank r, receive_splits[r]
    come from it."""
    received = rows.new_empty((sum(receive_splits), *rows.shape[1:]))
    return all_to_all_single(received, rows.contiguous(), receive_splits, send_splits, group=group)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _local_experts(module: nn.Module, rows: torch.Tensor, counts: list) -> torch.Tensor:
    """This rank's experts on their rows (`counts[e]` rows each, in local expert order): the gated MLP of
    transformers' experts, down(act(gate) * up), with the kernel local_experts picks for the rows' device, dtype
    and sizes."""
    gate_up, down = (_local(getattr(module, name)) for name in WEIGHTS)
    kernel = local_experts.local_kernel(rows.device.type, rows.dtype, (down.shape[1], down.shape[2], gate_up.shape[1]),
                                        _capability(rows.device))
    return local_experts.run(kernel, rows, counts, gate_up, down, module._apply_gate)


def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def shard_experts(experts: list, fsdp_kwargs: dict, host_collectives: bool) -> None:
    """`fully_shard` each experts module over `fsdp_kwargs["mesh"]` (`expert_dp`: the ranks holding the same
    experts), before the layers around them are sharded over every data-parallel rank.

    Gradients: a rank's experts receive the gradient of every token of its ep group that chose them — each token
    once, from the one tp rank whose slice holds it (a tp group's ranks share their tokens) — so a sum over the
    expert mesh covers each data-parallel rank's tokens once: the same sum every other unit makes over its
    larger mesh (parallelize.sum_gradients: every unit sums, none divides, the loss carries 1 / global tokens).
    Nothing is scaled per unit, so the expert group's size never enters (Hugging Face, which averages
    gradients, divides the expert units' by dp_size instead of their mesh's size: transformers
    distributed/fsdp.py, apply_fully_sharded_data_parallelism). Router weights stay in their dtype (float32)
    through the experts' forward, as without expert parallelism, where the experts are no FSDP unit of their
    own. `host_collectives`: CPU ranks gather and reduce through shared memory (plan.cpu_collectives=auto), on a
    one-dimensional expert mesh."""
    mesh = fsdp_kwargs["mesh"]
    policy = dataclasses.replace(fsdp_kwargs["mp_policy"], cast_forward_inputs=False)
    for module in experts:
        fully_shard(module, **{**fsdp_kwargs, "mp_policy": policy})
    if host_collectives and mesh.ndim == 1 and mesh.size() > 1:
        use_cpu_collectives(experts, mesh.get_group())
