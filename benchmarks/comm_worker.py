"""One torchrun rank of the communication benchmark (`python -m benchmarks.run --only communication`).

    python -m torch.distributed.run --nproc_per_node N -m benchmarks.comm_worker OUT.json steps|collectives [--config.a.b=v ...]

`steps`: trains a few steps through the torch backend's own `init` / `train_step`, counting the bytes
each rank sends (see ByteCounter). `collectives`: times gloo's reduce_scatter_tensor and
all_gather_into_tensor against our replacements (portable_fsdp/backends/torch/cpu_collectives.py) at the size of one
transformer layer.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import config_from_flags
from portable_fsdp import backends
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.config.validate import resolve_plan


def sent_fraction(world: int) -> float:
    return (world - 1) / world


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CountedComm:
    """Wraps an FSDP2 AllGather / ReduceScatter object (gloo's, or ours from cpu_collectives) and counts the
    bytes a bandwidth-optimal network collective sends per rank for that call: (N-1)/N of the gathered
    output or of the reduce-scatter input — the volume 3·P·(N-1)/N speaks of. It counts what FSDP2 asks
    for (how many collectives, their padded sizes), not bytes on a wire: shared memory moves them through
    RAM instead, gloo's own algorithms may send more."""

    def __init__(self, inner, counter: "ByteCounter", kind: str):
        self.inner, self.counter, self.kind = inner, counter, kind

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        whole = output_tensor if self.kind == "all_gather" else input_tensor
        self.counter.add(self.kind, nbytes(whole) * sent_fraction(group.size()))
        return self.inner(output_tensor, input_tensor, group, *args, **kwargs)


class ByteCounter:
    """Bytes each rank sends per step: FSDP2's all-gathers and reduce-scatters, counted where FSDP2 calls
    its comm objects (a private attribute of torch 2.9's FSDPParamGroup: benchmark code only), and every
    other torch.distributed all-reduce / all-gather (the step's scalars)."""

    def __init__(self):
        self.sent = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.enabled = False

    def add(self, kind: str, amount: float) -> None:
        if self.enabled:
            self.sent[kind] += int(amount)

    def wrap_fsdp(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None:
                group._all_gather_comm = CountedComm(group._all_gather_comm, self, "all_gather")
                group._reduce_scatter_comm = CountedComm(group._reduce_scatter_comm, self, "reduce_scatter")

    def install_scalars(self) -> None:
        for name, size_of, factor in (("all_reduce", lambda t, *_, **__: nbytes(t), lambda w: 2 * sent_fraction(w)),
                                      ("all_gather", lambda outs, t, *_, **__: nbytes(t), lambda w: w - 1)):
            original = getattr(dist, name)

            def call(*args, _original=original, _size_of=size_of, _factor=factor, **kwargs):
                self.add("all_reduce", _size_of(*args, **kwargs) * _factor(dist.get_world_size(kwargs.get("group"))))
                return _original(*args, **kwargs)

            setattr(dist, name, call)


def measure_steps(overrides: list, steps: int = 2) -> dict:
    counter = ByteCounter()
    counter.install_scalars()
    config = config_from_flags(overrides)
    backend = backends.load("cpu")
    state = backend.init(config, resolve_plan(config, int(os.environ["WORLD_SIZE"])), "cpu")
    counter.wrap_fsdp(state.model)
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    state, _ = backend.train_step(state, batches.micro_batches(0, where.dp_rank, where.dp_size))  # lazy init
    counter.enabled = True
    for step in range(1, steps + 1):
        state, _ = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
    counter.enabled = False
    from torch.distributed.fsdp import FSDPModule

    in_units = {id(p) for m in state.model.modules() if isinstance(m, FSDPModule) and m is not state.model
                for p in m.parameters()}
    # logical (unsharded) sizes; the root's own parameters (embeddings, lm_head, final norm) stay gathered
    # from forward to backward (FSDP2's default for the root), so they are all-gathered once per step
    param_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    root_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters() if id(p) not in in_units)
    backend.finalize(state)
    return {"param_bytes": param_bytes, "root_param_bytes": root_bytes, "world_size": where.world_size,
            "sent_per_step": {k: v / steps for k, v in counter.sent.items()}}


def time_collectives(numel: int, repeats: int = 10) -> dict:
    from portable_fsdp.backends.torch.cpu_collectives import (AllToAllReduceScatter, SharedBuffers,
                                                              SharedMemoryAllGather, SharedMemoryReduceScatter)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    full, shard = torch.randn(numel), torch.randn(numel // world)
    buffers = SharedBuffers(group)
    shared_gather, shared_reduce, all_to_all = SharedMemoryAllGather(buffers), SharedMemoryReduceScatter(buffers), AllToAllReduceScatter()

    def gather(comm):  # as FSDP2 does it: allocate the output, copy this rank's shard into its slot, gather
        output = comm.allocate((numel,), dtype=torch.float32, device=torch.device("cpu")) if comm else torch.empty(numel)
        slot = output.narrow(0, rank * shard.numel(), shard.numel())
        slot.copy_(shard)
        if comm:
            comm(output, slot, group)
        else:
            dist.all_gather_into_tensor(output, slot)

    cases = {"all-gather: gloo": lambda: gather(None),
             "all-gather: shared memory (ours, one host)": lambda: gather(shared_gather),
             "reduce-scatter: gloo": lambda: dist.reduce_scatter_tensor(torch.empty(numel // world), full),
             "reduce-scatter: all-to-all + sum (ours, several hosts)":
                 lambda: all_to_all(torch.empty(numel // world), full, group, dist.ReduceOp.SUM),
             "reduce-scatter: shared memory (ours, one host)":
                 lambda: shared_reduce(torch.empty(numel // world), full, group, dist.ReduceOp.SUM)}
    times = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved, so drift hits every case alike
        for name, call in cases.items():
            dist.barrier()
            began = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - began)
    dist.destroy_process_group()
    return {"world_size": world, "megabytes": numel * 4 / 1e6,
            "median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()}}


def main() -> None:
    out, mode, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode not in ("steps", "collectives"):
        sys.exit(f"error: mode {mode!r}: use steps (with --config.a.b=value flags) or collectives (with an element count)")
    result = measure_steps(overrides) if mode == "steps" else time_collectives(int(overrides[0]))
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
