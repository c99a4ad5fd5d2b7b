"""FSDP2's gradient reduce-scatter for gloo (CPU).

gloo's `reduce_scatter_tensor` takes about twice as long as an all-reduce of the same tensor (measured:
2 ranks, 12 MB, 21-23 ms vs 14 ms; `python -m benchmarks.run --only collectives`). An all-to-all of the N
chunks followed by a local sum moves the minimum, S·(N-1)/N bytes per rank, and took 15 ms. FSDP2 lets
a module swap its reduce-scatter (`FSDPModule.set_custom_reduce_scatter`); this is the swap.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAllReduceScatter:
    """FSDP2's ReduceScatter protocol: `allocate` the output, then reduce-scatter into it."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or async_op:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = group.size()
        received = torch.empty_like(input_tensor)  # chunk i of every rank, in rank order, lands on rank i
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def use_all_to_all_reduce_scatter(modules) -> None:
    comm = AllToAllReduceScatter()
    for module in modules:
        module.set_custom_reduce_scatter(comm)
