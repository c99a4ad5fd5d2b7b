"""FSDP2's all-gather and reduce-scatter for CPU ranks (gloo), swapped in through
`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` (`plan.cpu_collectives=auto`).

gloo moves every byte through TCP, even between processes on one host, and its `reduce_scatter_tensor`
takes about twice as long as an all-reduce of the same tensor. Measured for one 12 MB layer, 2 ranks
(`python -m benchmarks.run --only communication`): all-gather 10 ms, reduce-scatter 14 ms over gloo;
4 ms and 2 ms through shared memory. So:

* ranks all on this host: collectives go through two buffers every rank maps from /dev/shm, in rounds
  of at most `BUFFER_BYTES`, so shared memory stays 2 x `BUFFER_BYTES` per rank whatever the size of an
  FSDP unit (it counts in every rank's resident memory). In a round a rank writes its part into its
  slot, a barrier, then each rank reads what it needs. Rounds use the two buffers in turn, all-gathers
  and reduce-scatters alike: to write into a buffer again (two rounds later) a rank must have passed
  the barrier of the round in between, which every rank reaches only after its reads of the round
  before — so nobody overwrites what another still reads, whatever FSDP2 does between calls. Every
  round finishes inside the call.
* ranks on several hosts, or no usable /dev/shm: gloo's all-gather, and a reduce-scatter made of one
  all-to-all of the N chunks plus a local sum (the minimum, S·(N-1)/N bytes per rank).

Barriers are gloo collectives: they honour the process group's timeout, so a lost peer is an error, not
a hang. A buffer's file is unlinked as soon as every rank has mapped it (nothing stays in /dev/shm), is
reserved up front (a full /dev/shm is a fallback with a warning, not a SIGBUS later), and carries a token
every rank checks (ranks that see different /dev/shm fall back instead of reading each other's zeros).
"""
from __future__ import annotations

import os
import secrets
import warnings

import torch
import torch.distributed as dist

from portable_fsdp.backends.torch import distributed

SHM_DIR = "/dev/shm"
TOKEN_BYTES = 16
# Per buffer (a rank maps two). A larger one saves barriers (~0.2 ms each) on units above it, and costs
# its size in every rank's resident memory.
BUFFER_BYTES = 16 * 2**20


def _sum_or_avg(op) -> bool:
    return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class _HostComm:
    """FSDP2 asks its comm objects for their buffers (`allocate`): plain host tensors here."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllToAllReduceScatter(_HostComm):
    """FSDP2's ReduceScatter protocol: an all-to-all of the N chunks, then a local sum."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if not _sum_or_avg(op):
            return distributed.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                                      async_op=async_op)
        world = group.size()
        received = torch.empty_like(input_tensor)  # chunk i of every rank, in rank order, lands on rank i
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None  # done: FSDP2 takes None as a finished collective, async_op or not


class SharedMemoryUnavailable(RuntimeError):
    pass


class SharedBuffers:
    """Two byte buffers every rank of `group` maps from one file each, used in turn by the rounds of every
    collective, grown together (up to `capacity`) when a round needs more: every rank asks for the same
    sizes in the same order (the same model, the same schedule). When they cannot be shared, `usable`
    turns False on every rank alike, with a warning, and the collectives use gloo from then on."""

    def __init__(self, group: dist.ProcessGroup, capacity: int = BUFFER_BYTES):
        self.group = group
        self.rank = dist.get_rank(group)
        self.capacity = capacity
        self.usable = True
        self.buffers: list = [None, None]
        self.turn = 0

    def rounds(self, length: int, bytes_per_element: int):
        """(start, count, buffer) for each round over `length` elements; stops early when shared memory
        turns out unusable (on every rank alike): the caller then redoes the whole call over gloo, which
        rewrites the output and only reads the input."""
        per_round = max(1, self.capacity // bytes_per_element)
        for start in range(0, length, per_round):
            count = min(per_round, length - start)
            if not self.usable:
                return
            try:
                shared = self._next(count * bytes_per_element)
            except SharedMemoryUnavailable as err:
                self.usable = False
                self.buffers = [None, None]  # gloo from now on: unmap what was made
                warnings.warn(f"FSDP collectives fall back to gloo over TCP: {err}", stacklevel=3)
                return
            yield start, count, shared

    def _next(self, nbytes: int) -> torch.Tensor:
        self.turn ^= 1
        current = self.buffers[self.turn]
        if current is None or current.numel() < TOKEN_BYTES + nbytes:
            self.buffers[self.turn] = None  # drop the old mapping before making a larger one
            self.buffers[self.turn] = current = self._map(TOKEN_BYTES + nbytes)
        return current[TOKEN_BYTES:TOKEN_BYTES + nbytes]

    def _map(self, nbytes: int) -> torch.Tensor:
        """Collective. Raises SharedMemoryUnavailable on every rank when any rank cannot share the buffer."""
        offer = [None]
        if self.rank == 0:
            offer[0] = self._create(nbytes)
        dist.broadcast_object_list(offer, src=dist.get_global_rank(self.group, 0), group=self.group)
        path, token = offer[0] or (None, None)
        mapped = None
        try:
            # torch.from_file would create a missing file: a rank that cannot see it must not map one
            if path is not None and os.path.exists(path):
                mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                if bytes(mapped[:TOKEN_BYTES].tolist()) != token:
                    mapped = None
        except (OSError, RuntimeError):  # this rank cannot map it: all ranks fall back together, below
            mapped = None
        finally:
            ok = torch.tensor([int(mapped is not None)])
            try:
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # every rank has mapped (or failed)
            finally:
                if path is not None and self.rank == 0:
                    os.unlink(path)
        if not ok.item():
            raise SharedMemoryUnavailable(f"{SHM_DIR} is not usable by every rank" if path else
                                          f"no {nbytes / 2**20:.1f} MB buffer could be made in {SHM_DIR}")
        return mapped

    @staticmethod
    def _create(nbytes: int):
        """A file of `nbytes` reserved in /dev/shm (pages allocated now, so a full tmpfs fails here) with a
        random token at its start; None when it cannot be made."""
        path = os.path.join(SHM_DIR, f"portable_fsdp_{secrets.token_hex(8)}")
        token = secrets.token_bytes(TOKEN_BYTES)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)
            os.pwrite(fd, token, 0)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        return path, token


class SharedMemoryAllGather(_HostComm):
    """FSDP2's AllGather protocol. Each round: every rank writes a piece of its shard into its slot, a
    barrier, every rank copies all slots into its output."""

    def __init__(self, buffers: SharedBuffers):
        self.buffers = buffers

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = group.size(), dist.get_rank(group)
        shard, source = input_tensor.numel(), input_tensor.view(-1)
        output = output_tensor.view(world, shard)
        done = 0
        for start, count, shared in self.buffers.rounds(shard, world * output_tensor.element_size()):
            slots = shared.view(output_tensor.dtype).view(world, count)
            slots[rank].copy_(source[start:start + count])
            dist.barrier(group=group)
            output[:, start:start + count].copy_(slots)
            done = start + count
        if done < shard:  # shared memory unusable
            return distributed.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return None  # done: FSDP2 takes None as a finished collective, async_op or not


class SharedMemoryReduceScatter(_HostComm):
    """FSDP2's ReduceScatter protocol. Each round: every rank writes the same piece of each of the N-1
    chunks other ranks own into its slot, a barrier, then each rank sums the pieces of its own chunk, its
    own input's among them, in rank order."""

    def __init__(self, buffers: SharedBuffers):
        self.buffers = buffers
        self.fallback = AllToAllReduceScatter()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        world, rank = group.size(), dist.get_rank(group)
        if not _sum_or_avg(op):
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        shard = output_tensor.numel()
        chunks, output = input_tensor.view(world, shard), output_tensor.view(-1)
        done = 0
        for start, count, shared in self.buffers.rounds(shard, world * (world - 1) * input_tensor.element_size()):
            # slots[writer] holds the writer's pieces of every chunk but its own, in chunk order
            slots = shared.view(input_tensor.dtype).view(world, world - 1, count)
            slots[rank, :rank].copy_(chunks[:rank, start:start + count])
            slots[rank, rank:].copy_(chunks[rank + 1:, start:start + count])
            dist.barrier(group=group)
            pieces = [chunks[rank, start:start + count] if writer == rank else
                      slots[writer, rank - 1 if rank > writer else rank] for writer in range(world)]
            piece = output[start:start + count]
            torch.add(pieces[0], pieces[1], out=piece)
            for later in pieces[2:]:
                piece.add_(later)
            done = start + count
        if done < shard:
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def use_cpu_collectives(modules, group: dist.ProcessGroup) -> None:
    """Shared memory when every rank of `group` is on this host (one node), else the all-to-all
    reduce-scatter with gloo's all-gather."""
    one_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) == dist.get_world_size()
    # Every rank must pick the same collectives (a barrier on one, a gloo call on another would only end
    # at the timeout): agree on the choice.
    usable = torch.tensor([int(one_host and os.path.isdir(SHM_DIR))])
    dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=group)
    if usable.item():
        buffers = SharedBuffers(group)
        all_gather, reduce_scatter = SharedMemoryAllGather(buffers), SharedMemoryReduceScatter(buffers)
    else:
        all_gather, reduce_scatter = None, AllToAllReduceScatter()
    for module in modules:
        if all_gather is not None:
            module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
