"""One torchrun rank of the mesh benchmark's byte count (`python -m benchmarks.mesh`):

    python -m torch.distributed.run --nproc_per_node N -m benchmarks.mesh_worker OUT.json cpu|cuda [--config.a.b=v ...]

Trains one warm-up step through the torch backend's own `init` / `train_step`, then counts the bytes this rank
sends in the next steps (benchmarks/comm_bytes.py) and writes, from rank 0, those counts and FSDP's part of the
formulas of benchmarks/mesh.py, unit by unit (`fsdp_expected`).
"""
from __future__ import annotations

import json
import os
import sys

from benchmarks.comm_bytes import CommBytes
from benchmarks.common import config_from_flags
from portable_fsdp import backends
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.config.validate import resolve_plan


def fsdp_expected(model) -> dict:
    """Bytes FSDP should send per step on this rank, unit by unit over the ranks each unit shards over (the
    experts of an expert-parallel model over fewer ranks than the rest): all-gather (2U - R)·f(n), reduce-scatter
    U·f(n), and for HSDP an all-reduce 2·(U/n)·f(r) — U a unit's unsharded bytes as FSDP holds them (a tensor-
    parallel weight's tp slice), R those of the units kept gathered from forward to backward: the root, and on CUDA
    the last layer (private attributes of torch's FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    expected = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is None:
            continue
        unit = sum(p._orig_size.numel() * p.sharded_param.element_size() for p in group.fsdp_params)
        n = group.mesh_info.shard_mesh_size
        replicas = getattr(group.mesh_info, "replicate_mesh_size", 1)
        kept = group.post_forward_mesh_info is None  # not resharded after forward: gathered once
        expected["all_gather"] += (unit if kept else 2 * unit) * (n - 1) / n
        expected["reduce_scatter"] += unit * (n - 1) / n
        expected["all_reduce"] += 2 * unit / n * (replicas - 1) / replicas
    return expected


def measure(backend_name: str, overrides: list, steps: int = 2) -> dict:
    config = config_from_flags(overrides)
    backend = backends.load(backend_name)
    state = backend.init(config, resolve_plan(config, int(os.environ["WORLD_SIZE"])), backend_name)
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    state, _ = backend.train_step(state, batches.micro_batches(0, where.dp_rank, where.dp_size))  # lazy init
    with CommBytes() as counter:
        for step in range(1, steps + 1):
            state, _ = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
    fsdp = fsdp_expected(state.model)
    memory = backend.memory_report(state)
    backend.finalize(state)
    return {"world_size": where.world_size, "dp_size": where.dp_size, "fsdp_expected": fsdp,
            "state_mb": memory["state_mb"], "grad_mb": memory["grad_mb"],
            "sent_per_step": {kind: sent / steps for kind, sent in counter.sent.items()}}


def main() -> None:
    out, backend_name, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    result = measure(backend_name, overrides)
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
