"""Run under torchrun (gloo): train each named scenario of tests/parity/custom_parts.py for N steps with the
user's parts, every rank passing its own, and write rank 0's per-step losses, learning rates and the parameters
tensor parallelism splits to JSON.
`resume_full` / `resume_sharded`: the mlp_parts scenario straight, and stopped at N/2 with a checkpoint of that
layout, then resumed into a fresh state.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/custom_parts_check.py OUT.json N S...
"""
import os
import sys
import tempfile

import torch.distributed as dist
from torch.distributed.tensor import DTensor

import portable_fsdp as pf
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.plan import StateDictType
from tests.dist.launch import write_results
from tests.parity.custom_parts import SCENARIOS

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def start(name: str, state_dict_type: str = "FULL_STATE_DICT"):
    scenario = SCENARIOS[name]
    config = scenario.config(**{"plan.state_dict_type": state_dict_type})
    parts = scenario.parts(config)
    plan = pf.plan_for(config, WORLD, "cpu", model=parts["model"])
    return config, plan, pf.init(config, plan, "cpu", **parts)


def train(backend, config, state, first: int, last: int) -> tuple:
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    losses, lrs = [], []
    for step in range(first, last):
        state, metrics = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        losses.append(metrics["loss"])
        lrs.append(metrics["lr"])
    return state, losses, lrs


def split_over_tp(model) -> list:
    """The parameters a tp mesh dimension splits."""
    split = []
    for name, p in model.named_parameters():
        dims = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        if "tp" in dims and p.placements[dims.index("tp")].is_shard():
            split.append(name)
    return split


def run(name: str, steps: int, backend) -> dict:
    config, _, state = start(name)
    state, losses, lrs = train(backend, config, state, 0, steps)
    return {"losses": losses, "lrs": lrs, "split_over_tp": split_over_tp(state.model)}


def resume(layout: str, steps: int, backend) -> dict:
    """mlp_parts straight, and stopped halfway with a checkpoint of `layout` then resumed."""
    config, _, state = start("mlp_parts", layout)
    _, straight, _ = train(backend, config, state, 0, steps)
    config, plan, state = start("mlp_parts", layout)
    state, first, _ = train(backend, config, state, 0, steps // 2)
    workdir = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(workdir)
    checkpoint = pf.save(backend, state, workdir[0], config, plan, "cpu")
    _, _, fresh = start("mlp_parts", layout)
    fresh = pf.load(backend, fresh, workdir[0], config, "cpu")
    _, second, _ = train(backend, config, fresh, fresh.step, steps)
    written = sorted(os.listdir(checkpoint))
    return {"straight": straight, "resumed": first + second, "files": written}


def main() -> None:
    out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    backend = pf.load_backend("cpu")
    results = {}
    for name in names:
        if name.startswith("resume_"):
            layout = {"resume_full": StateDictType.FULL_STATE_DICT, "resume_sharded": StateDictType.SHARDED_STATE_DICT}
            results[name] = resume(layout[name].value, steps, backend)
        else:
            results[name] = run(name, steps, backend)
    write_results(out, results)
    backend.finalize()


if __name__ == "__main__":
    main()
