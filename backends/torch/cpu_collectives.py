"""FSDP2's all-gather and reduce-scatter for CPU ranks (gloo), swapped in through
`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` (`plan.cpu_collectives=auto`).

gloo moves every byte through TCP, even between processes on one host, and its `reduce_scatter_tensor`
takes about twice as long as an all-reduce of the same tensor. Measured for one 12 MB layer, 2 ranks
(`python -m benchmarks.run --only communication`): all-gather 11 ms, reduce-scatter 15 ms over gloo;
1-3 ms and 4 ms through shared memory. So:

* ranks all on this host: each collective goes through a buffer every rank maps from /dev/shm. A rank
  writes its part into its slot, a barrier, then each rank reads what it needs, all inside the call.
  Each kind alternates between two buffers: to write into a buffer again (two calls later) a rank must
  have passed the barrier of the call in between, which every rank reaches only after its reads of the
  call before — so nobody overwrites what another still reads, whatever FSDP2 does between calls.
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

SHM_DIR = "/dev/shm"
TOKEN_BYTES = 16


def _sum_or_avg(op) -> bool:
    return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class AllToAllReduceScatter:
    """FSDP2's ReduceScatter protocol: `allocate` a buffer, then reduce-scatter into the output."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if not _sum_or_avg(op):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
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


class _SharedMemoryCollective:
    """Shared buffers, and gloo when they turn out to be unusable (decided on every rank alike)."""

    def __init__(self, group: dist.ProcessGroup):
        self.buffers = SharedBuffers(group)
        self.usable = True

    def shared(self, nbytes: int) -> torch.Tensor | None:
        if self.usable:
            try:
                return self.buffers.next(nbytes)
            except SharedMemoryUnavailable as err:
                self.usable = False
                warnings.warn(f"FSDP collectives fall back to gloo over TCP: {err}", stacklevel=3)
        return None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SharedMemoryAllGather(_SharedMemoryCollective):
    """FSDP2's AllGather protocol: every rank writes its shard into its slot, a barrier, every rank copies
    the whole buffer into its output."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        shared = self.shared(output_tensor.numel() * output_tensor.element_size())
        if shared is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        shared = shared.view(output_tensor.dtype)
        shard = input_tensor.numel()
        shared[dist.get_rank(group) * shard:][:shard].copy_(input_tensor.view(-1))
        dist.barrier(group=group)
        output_tensor.view(-1).copy_(shared)
        return None  # done: FSDP2 takes None as a finished collective, async_op or not


class SharedMemoryReduceScatter(_SharedMemoryCollective):
    """FSDP2's ReduceScatter protocol: each rank writes its whole input into its slot, a barrier, then sums
    its own chunk over every slot, in rank order (the same order on every rank)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__(group)
        self.fallback = AllToAllReduceScatter()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if not _sum_or_avg(op):
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), dist.get_rank(group)
        shared = self.shared(world * input_tensor.numel() * input_tensor.element_size())
        if shared is None:
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        slots = shared.view(input_tensor.dtype).view(world, input_tensor.numel())
        slots[rank].copy_(input_tensor.view(-1))
        dist.barrier(group=group)
        torch.sum(slots.view(world, world, -1)[:, rank], dim=0, out=output_tensor)
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
        all_gather, reduce_scatter = SharedMemoryAllGather(group), SharedMemoryReduceScatter(group)
    else:
        all_gather, reduce_scatter = None, AllToAllReduceScatter()
    for module in modules:
        if all_gather is not None:
            module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
