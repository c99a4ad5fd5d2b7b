"""Train scenarios of tests/parity/custom_parts.py (a user's model, loss, optimizer, schedule) with the xla backend
on PJRT CPU devices under SPMD FSDPv2, in one process, and write what the tests check to JSON:

    python tests/xla/custom_parts_check.py OUT.json DEVICES STEPS SCENARIO...

Per scenario: per-step losses and learning rates, and each parameter's sharding.
`resume_full`: mlp_meta straight, and stopped halfway with a FULL checkpoint then resumed into a fresh state.
`refusals`: the one-line errors of parts the xla backend cannot take (FSDP v1; a SHARDED checkpoint of an
optimizer passed in), and the warning of a FULL one.
"""
import os
import pathlib
import sys
import tempfile
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp.backends.xla import environment  # noqa: E402  (imports no torch_xla)

DEVICES = int(sys.argv[2])
environment.configure(DEVICES)
os.environ.setdefault("PJRT_DEVICE", "CPU")

import json  # noqa: E402

import torch_xla  # noqa: E402

import portable_fsdp as pf  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from portable_fsdp.data.loader import TrainBatches, build_token_data  # noqa: E402
from portable_fsdp.errors import UserError  # noqa: E402
from tests.parity.custom_parts import SCENARIOS  # noqa: E402


def start(name: str, **extra):
    scenario = SCENARIOS[name]
    config = scenario.config(**extra)
    plan = resolve_plan(config, DEVICES)
    return config, plan, pf.init(config, plan, "xla", **scenario.parts(config))


def train(backend, config, state, first: int, last: int) -> tuple:
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    losses, lrs = [], []
    for step in range(first, last):
        state, metrics = backend.train_step(state, batches.micro_batches(step, 0, 1))
        losses.append(metrics["loss"])
        lrs.append(metrics["lr"])
    return state, losses, lrs


def shardings(state) -> dict:
    """{parameter name: its xla sharding spec}."""
    return {n.name: torch_xla._XLAC._get_xla_sharding_spec(n.param) for n in state.ctx.named}


def run(name: str, steps: int, backend) -> dict:
    config, _, state = start(name)
    state, losses, lrs = train(backend, config, state, 0, steps)
    return {"losses": losses, "lrs": lrs, "shardings": shardings(state)}


def resume_full(steps: int, backend) -> dict:
    config, _, state = start("mlp_meta")
    _, straight, _ = train(backend, config, state, 0, steps)
    config, plan, state = start("mlp_meta")
    state, first, _ = train(backend, config, state, 0, steps // 2)
    workdir = tempfile.mkdtemp(prefix="xla-custom-")
    checkpoint = pf.save(backend, state, workdir, config, plan, "xla")
    _, _, fresh = start("mlp_meta")
    fresh = pf.load(backend, fresh, workdir, config, "xla")
    _, second, _ = train(backend, config, fresh, fresh.step, steps)
    return {"straight": straight, "resumed": first + second, "files": sorted(os.listdir(checkpoint))}


def refusals() -> dict:
    messages = {}
    for case, extra in (("fsdp_v1", {"plan.xla_fsdp_v2": "false"}),
                        ("sharded_optimizer", {"plan.state_dict_type": "SHARDED_STATE_DICT"})):
        try:
            start("mlp_parts", **extra)
        except UserError as err:
            messages[case] = str(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start("mlp_parts")
    messages["full_optimizer"] = [str(w.message) for w in caught if str(w.message).startswith("optimizer:")]
    return messages


def main() -> None:
    out, steps, names = sys.argv[1], int(sys.argv[3]), sys.argv[4:]
    backend = pf.load_backend("xla")
    results = {}
    for name in names:
        if name == "resume_full":
            results[name] = resume_full(steps, backend)
        elif name == "refusals":
            results[name] = refusals()
        else:
            results[name] = run(name, steps, backend)
    pathlib.Path(out).write_text(json.dumps(results))
    backend.finalize()


if __name__ == "__main__":
    main()
