"""Collectives with exact autograd, written out (torch.distributed.nn.functional.all_gather gave wrong
K/V gradients in our checks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from portable_fsdp.backends.torch import distributed


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along the sequence dim (dim 2 of [b, h, L, d]) in group-rank order.
    Backward: reduce-scatter (sum) of the gradient — every rank's queries used every gathered block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        local = x.movedim(2, 0).contiguous()
        out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
        distributed.all_gather_single(out, local, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        full = grad.movedim(2, 0).contiguous()
        out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=grad.dtype, device=grad.device)
        distributed.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, 2), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def gather_sequence_no_grad(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather along `dim` without autograd (index and document-id tensors, predictions)."""
    world = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    distributed.all_gather_single(out, local, group=group)
    return out.movedim(0, dim)


class Exchange:
    """Send `tensors` to the next rank of the ring while receiving the same shapes from the previous one.
    Holds the outgoing buffers until `wait()`, so an asynchronous send never reads freed memory."""

    def __init__(self, tensors: list, group, send_to: int, recv_from: int):
        self._outgoing = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self._outgoing]
        ops = [dist.P2POp(dist.isend, t, send_to, group) for t in self._outgoing]
        ops += [dist.P2POp(dist.irecv, r, recv_from, group) for r in self.received]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list:
        for work in self._works:
            work.wait()
        self._outgoing = None
        return self.received
