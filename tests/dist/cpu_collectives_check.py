"""Run under torchrun: our CPU collectives (portable_fsdp/backends/torch/cpu_collectives.py) against gloo's, used the way
FSDP2 uses them, several times with other sizes (the buffers alternate and grow), with shared memory
working, in many rounds through small buffers, with no /dev/shm, with a rank that cannot see rank 0's
file, and with a buffer that cannot be made after a call's first round. Writes {case: max abs
difference over ranks}, the fall-back warnings and the shared files left behind, from rank 0 to argv[1]."""
import contextlib
import json
import os
import sys
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from portable_fsdp.backends.torch import cpu_collectives, distributed
from portable_fsdp.backends.torch.cpu_collectives import (SHM_DIR, AllToAllReduceScatter, SharedBuffers,
                                                          SharedMemoryAllGather, SharedMemoryReduceScatter)


def worst(difference: torch.Tensor) -> float:
    value = torch.tensor(difference.abs().max().item())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def compare(group, rank, world, prefix: str, results: dict, buffer_bytes: int) -> dict:
    buffers = SharedBuffers(group, buffer_bytes)  # one pair for both kinds, as use_cpu_collectives does
    gather, reduce_scatters = SharedMemoryAllGather(buffers), {
        "all_to_all": AllToAllReduceScatter(), "shared": SharedMemoryReduceScatter(buffers)}
    for round_, chunk in enumerate((1000, 3000, 500, 3000)):
        generator = torch.Generator().manual_seed(100 * round_ + rank)
        full, shard = torch.randn(world * chunk, generator=generator), torch.randn(chunk, generator=generator)
        output = gather.allocate((world * chunk,), dtype=torch.float32, device=torch.device("cpu"))
        output.narrow(0, rank * chunk, chunk).copy_(shard)  # FSDP2's copy-in
        gather(output, output.narrow(0, rank * chunk, chunk), group)
        expected = torch.empty(world * chunk)
        distributed.all_gather_single(expected, shard)
        results[f"{prefix}all_gather/{round_}"] = worst(output - expected)
        for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
            expected = torch.empty(chunk)
            # gloo has no AVG reduce-scatter: compare with the sum, divided
            distributed.reduce_scatter_single(expected, full.clone(),
                                              op=dist.ReduceOp.SUM if op_name == "avg" else op)
            if op_name == "avg":
                expected /= world
            for name, comm in reduce_scatters.items():
                ours = comm.allocate((chunk,), dtype=torch.float32, device=torch.device("cpu"))
                comm(ours, full.clone(), group, op)
                results[f"{prefix}{name}/{op_name}/{round_}"] = worst(ours - expected)
    mapped = [buffer.numel() - cpu_collectives.TOKEN_BYTES for buffer in buffers.buffers if buffer is not None]
    return {"usable": buffers.usable, "largest_buffer": max(mapped, default=0)}


def main() -> None:
    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    before = set(os.listdir(SHM_DIR))
    results, buffers, caught = {}, {}, {}
    real_exists, real_create = os.path.exists, SharedBuffers._create
    made = []

    def create_only_one(nbytes):  # rank 0 makes the buffers: the second one fails, in a call's second round
        made.append(nbytes)
        return real_create(nbytes) if len(made) == 1 else None

    default = cpu_collectives.BUFFER_BYTES
    scenarios = {  # prefix: (patch, bytes per buffer)
        "": (contextlib.nullcontext(), default),
        # rounds of 170 (reduce-scatter) and 341 (all-gather) elements at 3 ranks, with a shorter last one
        "rounds/": (contextlib.nullcontext(), 4096),
        "no_shm/": (mock.patch.object(cpu_collectives, "SHM_DIR", "/nonexistent/shm"), default),
        # rank 1 lives elsewhere: rank 0's file is not there for it
        "not_shared/": (mock.patch("os.path.exists", lambda path: real_exists(path) and rank != 1), default),
        # the all-gather's first round went through shared memory, then the whole call is redone over gloo
        "late_failure/": (mock.patch.object(SharedBuffers, "_create", staticmethod(create_only_one)), 4096),
    }
    for prefix, (patch, buffer_bytes) in scenarios.items():
        with patch, warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            buffers[prefix] = compare(group, rank, world, prefix, results, buffer_bytes)
        caught[prefix] = [str(r.message) for r in records]
    dist.barrier()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"differences": results, "buffers": buffers, "warnings": caught,
                       "left_in_shm": sorted(set(os.listdir(SHM_DIR)) - before)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
