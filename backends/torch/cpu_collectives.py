"""FSDP2's all-gather and reduce-scatter for CPU ranks (gloo), swapped in through
`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`.

gloo moves every byte through TCP, even between processes on one host, and its `reduce_scatter_tensor`
takes about twice as long as an all-reduce of the same tensor (measured with 2 ranks and 12 MB: 21-23 ms
vs 14 ms; see `python -m benchmarks.run --only communication`). Two replacements:

* ranks all on this host: the buffers live in shared memory. FSDP2 copies each rank's shard straight
  into its slot of the all-gather output (`allocate` hands out the shared buffer), so the all-gather is
  one barrier; a reduce-scatter writes each rank's input into its slot and sums its own chunk over the
  slots. Each collective kind alternates between two buffers: a barrier per call means a rank can only
  reuse a buffer once every rank has left the call before, so nobody overwrites what another still reads.
* ranks on several hosts: the reduce-scatter is an all-to-all of the N chunks and a local sum, which
  moves the minimum, S·(N-1)/N bytes per rank (gloo's all-gather is kept).

Barriers are gloo collectives: they honour the process group's timeout, so a lost peer is an error, not a
hang. Shared files are unlinked as soon as every rank has mapped them: nothing is left in /dev/shm.
"""
from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


def _sum_or_avg(op) -> bool:
    return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class AllToAllReduceScatter:
    """FSDP2's ReduceScatter protocol: `allocate` a buffer, then reduce-scatter into the output."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if not _sum_or_avg(op) or async_op:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = group.size()
        received = torch.empty_like(input_tensor)  # chunk i of every rank, in rank order, lands on rank i
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


class SharedBuffers:
    """Byte buffers every rank of `group` maps from one file, two per use, grown together when a request
    is larger (every rank asks for the same sizes in the same order: the same model, the same schedule)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.buffers: list = [None, None]
        self.turn = 0

    def next(self, nbytes: int) -> torch.Tensor:
        self.turn ^= 1
        current = self.buffers[self.turn]
        if current is None or current.numel() < nbytes:
            self.buffers[self.turn] = current = self._map(nbytes)
        return current[:nbytes]

    def _map(self, nbytes: int) -> torch.Tensor:
        name = [os.path.join(SHM_DIR, f"portable_fsdp_{uuid.uuid4().hex}") if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
        if self.rank == 0:
            with open(name[0], "wb") as f:
                f.truncate(nbytes)
        dist.barrier(group=self.group)
        try:
            mapped = torch.from_file(name[0], shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            dist.barrier(group=self.group)  # every rank has it mapped (or failed): the name can go
            if self.rank == 0:
                os.unlink(name[0])
        return mapped


class SharedMemoryAllGather:
    """FSDP2's AllGather protocol. The output FSDP2 allocates is shared: its copy-in writes each rank's
    shard into the rank's slot, so the gather itself is a barrier."""

    def __init__(self, group: dist.ProcessGroup):
        self.buffers = SharedBuffers(group)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        return self.buffers.next(numel * dtype.itemsize).view(dtype).view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        shared = self.buffers.buffers[self.buffers.turn]
        if async_op or shared is None or output_tensor.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr():
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        dist.barrier(group=group)
        return None


class SharedMemoryReduceScatter:
    """FSDP2's ReduceScatter protocol: each rank writes its whole input into its slot, then sums its own
    chunk over every slot, in rank order (the same order on every rank)."""

    def __init__(self, group: dist.ProcessGroup):
        self.buffers = SharedBuffers(group)
        self.fallback = AllToAllReduceScatter()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if not _sum_or_avg(op) or async_op:
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), dist.get_rank(group)
        slots = self.buffers.next(world * input_tensor.numel() * input_tensor.element_size())
        slots = slots.view(input_tensor.dtype).view(world, input_tensor.numel())
        slots[rank].copy_(input_tensor)
        dist.barrier(group=group)
        torch.sum(slots.view(world, world, -1)[:, rank], dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def use_cpu_collectives(modules, group: dist.ProcessGroup) -> None:
    """Shared memory when every rank of `group` is on this host (one node), else the all-to-all
    reduce-scatter."""
    one_host = int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == dist.get_world_size() and os.path.isdir(SHM_DIR)
    all_gather = SharedMemoryAllGather(group) if one_host else None
    reduce_scatter = SharedMemoryReduceScatter(group) if one_host else AllToAllReduceScatter()
    for module in modules:
        if all_gather is not None:
            module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
