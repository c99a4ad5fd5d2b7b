"""A MoE layer's experts computed on the tokens routed to them, dropless: each token-slot (a token and one of its
top-k experts) runs through its expert's MLP once, and the router's weights combine a token's slots.

Within one device the slots are sorted by expert and run through a grouped matmul (`expert_mlp`). Which one is a
choice of platform (`kernel_for`): `jax.lax.ragged_dot` where it is a grouped matmul (GPU, TPU); on CPU XLA
lowers ragged_dot densely — every group over every row, num_experts × the routed work — so there each expert's
slots are cut into fixed-size blocks (portable_fsdp/routed_blocks.py) and every block multiplies by its expert's
weights in one batched einsum. A memory estimate for a GPU or TPU compiles on host devices, where neither holds
the buffers the accelerator's grouped matmul does; it traces `grouped_stand_in`, which does.

On a mesh (`routed_experts`) the layer runs under `shard_map`: the experts are split over the plan's expert axes
(placement.expert_axes: ep, whose devices hold different tokens, and tp, whose devices hold the same ones). Each
device sends its slots to the ep rank owning their expert with one `all_to_all` and gets the results back with
another; of the tp ranks, each sends only the slots of its own experts, and the combined outputs are summed over
tp. Shapes are static, so each device reserves room for the worst case — every slot it can receive —:
tokens × min(top_k, experts per device) slots from each of its ep peers (a token chooses an expert at most once).
A device therefore computes up to ep × that many rows, ep_size × min(1, experts per device / top_k) times its
average routed work, and never more than computing its experts on every token of its ep group would (the CPU
blocks' padding aside: flops.py counts both).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from portable_fsdp.placement import EP, TP
from portable_fsdp.routed_blocks import block_count, block_rows, capacity
from portable_fsdp.backends.flax import sharding

GROUPED_MATMUL_PLATFORMS = ("gpu", "tpu")  # where jax.lax.ragged_dot computes only the rows of each group


def kernel_for(platform: str, compiled_on: str | None = None):
    """The grouped matmul for a jax device `platform` ("cpu", "gpu", "tpu"): `ragged_mlp` where ragged_dot is one,
    `block_mlp` elsewhere; `grouped_stand_in` when the program for a GPU or TPU is compiled on the devices of
    another platform (`compiled_on`: a memory estimate's host CPUs). The platforms are passed in, not read here,
    so that every choice is testable on CPU."""
    if platform not in GROUPED_MATMUL_PLATFORMS:
        return block_mlp
    return ragged_mlp if compiled_on in (None, platform) else grouped_stand_in


def ragged_mlp(rows, experts, sizes, gate_up, down):
    """rows [n, hidden] sorted by their `experts` [n] ([E] rows of each: `sizes`) through their experts' MLPs
    (gate_up [E, 2, hidden, I], down [E, I, hidden]); rows past the groups (expert E: none) are never read back."""
    del experts  # the group sizes say it
    gate = jax.lax.ragged_dot(rows, gate_up[:, 0], sizes)
    up = jax.lax.ragged_dot(rows, gate_up[:, 1], sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, sizes)


def grouped_stand_in(rows, experts, sizes, gate_up, down):
    """The buffers `ragged_mlp` holds on a GPU or TPU, for XLA's memory analysis on host devices, never run: each
    product one matmul over all the rows (the grouped matmul's inputs and outputs), every expert's weights read and
    their gradients whole. ragged_dot's CPU lowering would hold a copy of the rows per expert, `block_mlp` its
    experts' weights per block (gigabytes at Qwen3-30B-A3B's 128 experts)."""
    del experts, sizes  # the values are never used: the shapes are
    weights = gate_up.sum(0)
    return (jax.nn.silu(rows @ weights[0]) * (rows @ weights[1])) @ down.sum(0)


def block_mlp(rows, experts, sizes, gate_up, down):
    """`ragged_mlp` in fixed-size blocks: each expert's rows in whole blocks (the rest zeros), each block times
    its expert's weights (gathered per block) in one batched einsum."""
    n, hidden = rows.shape
    num_experts = sizes.shape[0]
    size = block_rows(n, num_experts)
    count = block_count(n, num_experts, size)
    padded = -(-sizes // size) * size
    padded_ends = jnp.cumsum(padded)
    expert = jnp.minimum(experts, num_experts - 1)
    rank = jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[expert]
    slot = jnp.where(experts < num_experts, padded_ends[expert] - padded[expert] + rank, count * size)
    blocks = jnp.zeros((count * size, hidden), rows.dtype).at[slot].set(rows, mode="drop")
    owner = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(count) * size, side="right"), num_experts - 1)
    gate_up_out = jnp.einsum("nbh,nphi->nbpi", blocks.reshape(count, size, hidden), gate_up[owner])
    hidden_out = jax.nn.silu(gate_up_out[..., 0, :]) * gate_up_out[..., 1, :]
    out = jnp.einsum("nbi,nih->nbh", hidden_out, down[owner]).reshape(count * size, hidden)
    return out.at[slot].get(mode="fill", fill_value=0)


def expert_mlp(rows, experts, gate_up, down, kernel):
    """rows [n, hidden] through the MLP of their `experts` [n] (gate_up [E, 2, hidden, I], down [E, I, hidden]);
    a row of expert E (none) gives zeros or anything, never read."""
    num_experts = gate_up.shape[0]
    order = jnp.argsort(experts)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[experts].add(1, mode="drop")
    out = kernel(rows[order], experts[order], sizes, gate_up, down)
    return jnp.zeros_like(out).at[order].set(out)


def expert_groups(mesh: Mesh, expert_axes: tuple) -> dict:
    """{axis: size} of the `expert_axes` the mesh splits, in order: ep (devices of other tokens), tp (of the same)."""
    return {axis: mesh.shape[axis] for axis in sharding.split_over(mesh, expert_axes)}


def routed_experts(x, weights, chosen, gate_up, down, mesh: Mesh | None, expert_axes: tuple,
                   platform: str | None = None):
    """x [b, s, hidden]; weights, chosen [b, s, top_k]: each token's router weights and experts. The experts'
    outputs combined by the weights, [b, s, hidden]. Off a mesh on the default device; on one, under shard_map with
    the experts split over `expert_axes` (placement.expert_axes). `platform`: the devices the program is for, when
    not those it is compiled on (a memory estimate)."""
    here = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    kernel = kernel_for(platform or here, here)
    if mesh is None:
        return _route(x, weights, chosen, gate_up, down, kernel, {})
    groups = expert_groups(mesh, expert_axes)
    tokens = PartitionSpec(sharding.rows(mesh), sharding.sequence(mesh))
    experts = PartitionSpec(sharding.entry(tuple(groups)))
    route = functools.partial(_route, kernel=kernel, groups=groups)
    return jax.shard_map(route, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts),
                         out_specs=tokens)(x, weights, chosen, gate_up, down)


def _route(x, weights, chosen, gate_up, down, kernel, groups: dict):
    """One device's tokens through the experts split over `groups` ({axis: size}: ep, tp or none)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    tokens, top_k = x.shape[0], chosen.shape[-1]
    local = gate_up.shape[0]
    peers, tp = groups.get(EP, 1), groups.get(TP, 1)
    owner, local_expert = jnp.divmod(chosen.reshape(-1), local)
    peer, owner_tp = jnp.divmod(owner, tp)
    if TP in groups:  # the tp ranks hold the same tokens: each sends the slots of its own experts
        peer = jnp.where(owner_tp == jax.lax.axis_index(TP), peer, peers)
    room = capacity(tokens, top_k, local)
    place = _places(peer, peers, room)
    token = jnp.arange(tokens * top_k) // top_k
    sent = jnp.zeros((peers * room, shape[-1]), x.dtype).at[place].set(x[token], mode="drop")
    sent_experts = jnp.full((peers * room,), local, jnp.int32).at[place].set(local_expert, mode="drop")
    if EP in groups:
        sent, sent_experts = (_exchange(t, peers) for t in (sent, sent_experts))
    out = expert_mlp(sent, sent_experts, gate_up, down, kernel)
    if EP in groups:
        out = _exchange(out, peers)
    slots = out.at[place].get(mode="fill", fill_value=0).reshape(tokens, top_k, -1)
    mixed = jnp.einsum("tkh,tk->th", slots, weights.reshape(tokens, top_k).astype(slots.dtype),
                       preferred_element_type=jnp.float32)
    if TP in groups:
        mixed = jax.lax.psum(mixed, TP)
    return mixed.astype(x.dtype).reshape(shape)


def _places(peer, peers: int, room: int):
    """Each slot's row in the send buffer [peers × room]: its peer's part, in slot order; peers × room (past the
    end: not sent) for a slot of peer `peers`."""
    mine = jax.nn.one_hot(peer, peers, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(mine, axis=0) - 1) * mine, axis=1)
    return jnp.where(peer < peers, peer * room + rank, peers * room)


def _exchange(buffer, peers: int):
    """Part p of this device's buffer to ep rank p; part q of the result came from ep rank q."""
    parts = buffer.reshape(peers, -1, *buffer.shape[1:])
    return jax.lax.all_to_all(parts, EP, 0, 0).reshape(buffer.shape)
