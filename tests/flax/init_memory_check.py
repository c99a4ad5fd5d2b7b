"""Run in a fresh process: place the initial weights of a ~110M-parameter Llama (tests/dist/meta_init_check.py's
LLAMA_100M: tied 32000 x 768 embeddings, 12 layers of 768 / 2048) on 2 JAX host devices split over fsdp, and print
as JSON what that added to the process's resident set at its largest. `meta` is the flax backend's way (the model
on the meta device, one parameter at a time: initial.prepare); `whole` is the way before, line for line: the torch
model built whole, its state dict converted, then every array put on the devices (jax.device_put).

    python -m tests.flax.init_memory_check {meta,whole}
"""
import json
import sys

from portable_fsdp.backends.flax.devices import configure_host_devices

configure_host_devices(2)

import jax  # noqa: E402

from portable_fsdp.machine import host_memory  # noqa: E402
from portable_fsdp.backends.flax import architecture, torch_weights, initial, model as model_lib, sharding  # noqa: E402
from portable_fsdp.backends.hf_torch.model import create_model  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from tests.dist.meta_init_check import LLAMA_100M  # noqa: E402
from tests.parity.matrix import make_config  # noqa: E402


def reset_peak() -> bool:
    """Start the resident set's high-water mark (VmHWM) from now; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**10


def placed_on_meta(config, mesh) -> dict:
    weights = initial.prepare(config, False)
    return jax.block_until_ready(weights.place(sharding.param_shardings(weights.model_def.shapes, mesh)))


def placed_whole(config, mesh) -> dict:
    hf_model = create_model(config, rank=0, rank0_only=False)
    model_def = model_lib.define(architecture.from_hf_config(hf_model.config))
    host = torch_weights.from_torch(hf_model.state_dict(), model_def.variables, model_def.arch)
    shardings = sharding.param_shardings(model_def.shapes, mesh)
    return jax.block_until_ready({name: jax.device_put(value, shardings[name]) for name, value in host.items()})


def main(mode: str) -> None:
    config = make_config(LLAMA_100M)
    plan = resolve_plan(config, 2)
    mesh = sharding.build_mesh(plan.mesh, jax.devices()[:2])
    for place in (placed_on_meta, placed_whole):  # libraries imported, runtime started: not the model's part
        place(make_config({}), mesh)
    reset = reset_peak()
    before = host_memory.resident_mb()
    params = (placed_on_meta if mode == "meta" else placed_whole)(config, mesh)
    peak = peak_mb() if reset else host_memory.peak_resident_mb()
    n_params = sum(a.size for a in params.values())
    print(json.dumps({"mode": mode, "params": n_params, "model_mb": n_params * 4 / 2**20, "before_mb": before,
                      "peak_mb": peak, "after_mb": host_memory.resident_mb(), "peak_reset": reset}))


if __name__ == "__main__":
    main(sys.argv[1])
