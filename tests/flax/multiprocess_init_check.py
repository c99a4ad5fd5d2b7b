"""Run as one of 2 JAX processes (jax.distributed over gloo, 2 host devices each): place the test recipe's initial
weights on a mesh of the 4 devices (fsdp 2 x tp 2) one parameter at a time, and write to JSON which shards this
process copied from the host (the indices jax.make_array_from_callback asked for) and whether each of its
addressable shards holds the whole build's values bit for bit.

    python -m tests.flax.multiprocess_init_check OUT.json PROCESS_ID PORT
"""
import json
import sys

from portable_fsdp.backends.flax.devices import configure_host_devices

configure_host_devices(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from portable_fsdp.backends.flax import architecture, torch_weights, devices, initial, sharding  # noqa: E402
from portable_fsdp.backends.hf_torch.model import create_model  # noqa: E402
from portable_fsdp.mesh_fit import tensor_parallel_plan  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from tests.parity.matrix import make_config  # noqa: E402


def main(out: str, process_id: int, port: int) -> None:
    devices.join({"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2, "process_id": process_id})
    config = make_config({"plan.tp_size": "2"})
    plan = resolve_plan(config, 4)
    mesh = sharding.build_mesh(plan.mesh, jax.devices())
    copied = []  # one entry per shard read from the host
    real = jax.make_array_from_callback

    def recording(shape, placement, callback):
        return real(shape, placement, lambda index: copied.append(index) or callback(index))

    jax.make_array_from_callback = recording
    weights = initial.prepare(config, False)
    info = architecture.describe_model(config)
    shardings = sharding.param_shardings(weights.model_def.shapes, mesh, tensor_parallel_plan(plan, info),
                                         torch_weights.torch_name)
    params = weights.place(shardings)
    hf_model = create_model(config, rank=0, rank0_only=False)
    expected = torch_weights.from_torch(hf_model.state_dict(), weights.model_def.variables, weights.model_def.arch)
    differing = [name for name, array in params.items() for shard in array.addressable_shards
                 if np.asarray(shard.data).tobytes() != expected[name][shard.index].tobytes()]
    result = {"process": jax.process_index(), "processes": jax.process_count(), "parameters": len(params),
              "copied_shards": len(copied),
              "addressable_shards": sum(len(a.addressable_shards) for a in params.values()),
              "global_shards": sum(len(a.sharding.device_set) for a in params.values()), "differing": differing,
              "tp_split": sum("tp" in str(a.sharding.spec) for a in params.values())}
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
