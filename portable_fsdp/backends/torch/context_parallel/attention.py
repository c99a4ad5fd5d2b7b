"""Portable context-parallel attention in plain PyTorch (runs on CPU, CUDA, anything).

Inputs are the local shards: q [b, h, Lc, d], k/v [b, hkv, Lc, d], plus the global token index of every
local position (and optional document ids), so the causal/document mask is exact whatever the split.
- allgather: K/V gathered over the cp group (autograd: reduce-scatter of their gradients), then one
  SDPA call with the exact mask.
- ring ("alltoall"): K/V blocks travel round the group; partial results merge with the online softmax,
  statistics in fp32; backward passes the blocks round again with their dK/dV accumulators. It computes
  in fp32 with query rows in chunks and keeps only q/k/v/out/log-sum-exp for backward (probabilities
  are recomputed), so its memory grows with chunk x block, not block^2.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from portable_fsdp.backends.torch.context_parallel.collectives import Exchange, gather_sequence, gather_sequence_no_grad


CHUNK_ELEMENTS = 1 << 24  # fp32 scores of one query chunk: 64 MiB


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where this rank's tokens sit in the full sequence (set for each batch by `sequence_shard`)."""

    group: object
    cp_rank: int
    cp_size: int
    rotate_method: str  # "allgather" | "alltoall"
    index_of_rank: tuple  # global token positions held by each cp rank, LongTensors [Lc]
    segments: torch.Tensor | None  # local document ids [b, Lc], or None for one document per row

    @property
    def q_index(self) -> torch.Tensor:
        return self.index_of_rank[self.cp_rank]


def block_mask(q_index, kv_index, q_segments=None, kv_segments=None) -> torch.Tensor:
    """True where query i may attend key j: causal in global positions, and same document."""
    mask = kv_index[None, :] <= q_index[:, None]  # [Lq, Lk]
    if q_segments is None:
        return mask[None, None]
    same_doc = q_segments[:, :, None] == kv_segments[:, None, :]  # [b, Lq, Lk]
    return (mask[None] & same_doc)[:, None]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _row_chunks(q_len: int, kv_len: int, heads: int) -> list:
    """Query rows per chunk so one chunk's scores stay near CHUNK_ELEMENTS floats (memory ~ O(rows x L))."""
    rows = max(1, CHUNK_ELEMENTS // max(1, heads * kv_len))
    return [slice(start, min(start + rows, q_len)) for start in range(0, q_len, rows)]


def _segment_rows(segments, rows):
    return None if segments is None else segments[:, rows]


def _attend_block(q32, k, v, q_index, kv_index, q_segments, kv_segments, scale):
    """Softmax attention of every query over one K/V block: (out [b,h,Lq,d] fp32, lse [b,h,Lq] fp32)."""
    n_rep = q32.shape[1] // k.shape[1]
    k32, v32 = _repeat_kv(k.float(), n_rep), _repeat_kv(v.float(), n_rep)
    outs, lses = [], []
    for rows in _row_chunks(q32.shape[2], k.shape[2], q32.shape[1]):
        mask = block_mask(q_index[rows], kv_index, _segment_rows(q_segments, rows), kv_segments)
        scores = (q32[:, :, rows] @ k32.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.exp(scores - _finite(lse)[..., None]) @ v32)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_grads(q32, dout, delta, lse, k, v, q_index, kv_index, q_segments, kv_segments, scale):
    """Gradients of one K/V block's share of the attention, recomputing probabilities chunk by chunk."""
    n_rep = q32.shape[1] // k.shape[1]
    k32, v32 = _repeat_kv(k.float(), n_rep), _repeat_kv(v.float(), n_rep)
    dq = torch.zeros_like(q32)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    for rows in _row_chunks(q32.shape[2], k.shape[2], q32.shape[1]):
        mask = block_mask(q_index[rows], kv_index, _segment_rows(q_segments, rows), kv_segments)
        scores = (q32[:, :, rows] @ k32.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        p = torch.exp(scores - lse[:, :, rows, None])
        dv += p.transpose(-1, -2) @ dout[:, :, rows]
        ds = p * (dout[:, :, rows] @ v32.transpose(-1, -2) - delta[:, :, rows])
        dq[:, :, rows] = ds @ k32 * scale
        dk += ds.transpose(-1, -2) @ q32[:, :, rows] * scale
    fold = (k.shape[0], k.shape[1], n_rep, *k.shape[2:])  # sum the grouped query heads back onto kv heads
    return dq, dk.view(fold).sum(2), dv.view(fold).sum(2)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees no key of this block) -> 0, so exp(s - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _weight(part_lse, total_lse) -> torch.Tensor:
    """exp(part - total), with 0 where the part saw no key (never NaN)."""
    return torch.where(torch.isfinite(part_lse), torch.exp(part_lse - total_lse), 0.0)[..., None]


def allgather_attention(q, k, v, layout: ShardLayout, scale: float) -> torch.Tensor:
    """One SDPA call over the gathered K/V with the exact mask (its fused CPU/CUDA kernels take a boolean
    mask and keep memory linear in the sequence)."""
    k_all = gather_sequence(k, layout.group)
    v_all = gather_sequence(v, layout.group)
    kv_segments = None
    if layout.segments is not None:
        kv_segments = gather_sequence_no_grad(layout.segments, layout.group, dim=1)
    mask = block_mask(layout.q_index, torch.cat(layout.index_of_rank), layout.segments, kv_segments)
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k_all, n_rep), _repeat_kv(v_all, n_rep),
                                          attn_mask=mask, scale=scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: ShardLayout, scale: float):
        ring = _Ring(layout)
        q32 = q.float()
        out = torch.zeros_like(q32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = [torch.stack([k, v])] + ([layout.segments] if layout.segments is not None else [])
        for step in range(layout.cp_size):
            pending = ring.pass_on(block) if step < layout.cp_size - 1 else None
            kv, segments = block[0], (block[1] if len(block) > 1 else None)
            block_out, block_lse = _attend_block(q32, kv[0], kv[1], layout.q_index, ring.index(step),
                                                 layout.segments, segments, scale)
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * _weight(lse, new_lse) + block_out * _weight(block_lse, new_lse)
            lse = new_lse
            if pending is not None:
                block = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        ring = _Ring(layout)
        q32, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # D_i = Σ_d dO·O
        dq = torch.zeros_like(q32)
        has_segments = layout.segments is not None
        # A travelling block: K/V stacked, their dK/dV accumulators stacked (fp32), document ids.
        block = [torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)]
        block += [layout.segments] if has_segments else []
        for step in range(layout.cp_size):
            kv, grads = block[0], block[1]
            block_dq, dk, dv = _block_grads(q32, dout, delta, lse, kv[0], kv[1], layout.q_index, ring.index(step),
                                            layout.segments, block[2] if has_segments else None, scale)
            dq += block_dq
            grads = grads + torch.stack([dk, dv])
            # After cp passes every block, with its complete dK/dV, is back with its owner.
            block = ring.pass_on([kv, grads] + block[2:]).wait()
        return dq.to(q.dtype), block[1][0].to(k.dtype), block[1][1].to(v.dtype), None, None


class _Ring:
    """Ring neighbours and which rank's block is held at each step."""

    def __init__(self, layout: ShardLayout):
        self.layout = layout
        size, rank = layout.cp_size, layout.cp_rank
        self.send_to = dist.get_global_rank(layout.group, (rank + 1) % size)
        self.recv_from = dist.get_global_rank(layout.group, (rank - 1) % size)

    def pass_on(self, tensors: list) -> Exchange:
        return Exchange(tensors, self.layout.group, self.send_to, self.recv_from)

    def index(self, step: int) -> torch.Tensor:
        """Global token positions of the block held at `step` (it started on rank cp_rank - step)."""
        return self.layout.index_of_rank[(self.layout.cp_rank - step) % self.layout.cp_size]


def ring_attention(q, k, v, layout: ShardLayout, scale: float) -> torch.Tensor:
    return _RingAttention.apply(q, k, v, layout, scale)
