"""Train named variants of the matrix (tests/parity/matrix.py) with the xla backend in one process and write
what the tests check to JSON.

    python tests/xla/xla_variants.py OUT.json DEVICES STEPS VARIANT...

DEVICES PJRT CPU devices for SPMD FSDPv2; the variants of one run must all be SPMD, or all FSDP v1 (then
DEVICES is 1), since torch_xla fixes both for the life of a process. Per variant: per-step losses and
compile counts, step times, each parameter's sharding, the shared eval layer's eval_loss before training,
and for "base" a SHARDED_STATE_DICT save, reload and resume.
"""
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp.backends.xla import environment  # noqa: E402  (imports no torch_xla)

DEVICES = int(sys.argv[2])
environment.configure(DEVICES)
os.environ.setdefault("PJRT_DEVICE", "CPU")

import json  # noqa: E402

from portable_fsdp import backends  # noqa: E402
from portable_fsdp.data.loader import TrainBatches, build_token_data, eval_batches  # noqa: E402
from portable_fsdp.evaluation import evaluate  # noqa: E402
from portable_fsdp.plan import StateDictType  # noqa: E402
from portable_fsdp.validate import resolve_plan  # noqa: E402
from tests.parity.matrix import VARIANTS, make_config  # noqa: E402

EVAL_BATCHES = 4


def parameter_shardings(state) -> dict:
    import torch_xla

    return {n.name: torch_xla._XLAC._get_xla_sharding_spec(n.param) for n in state.ctx.named}


def moment_shardings(state) -> dict:
    import torch_xla

    return {n.name: torch_xla._XLAC._get_xla_sharding_spec(state.optimizer.state[n.param]["exp_avg"])
            for n in state.ctx.named}


def input_sharding(state, batch) -> str:
    import torch_xla

    from portable_fsdp.backends.xla import runtime as rt

    (input_ids,) = rt.to_device(state.ctx.runtime, [batch.input_ids])
    return torch_xla._XLAC._get_xla_sharding_spec(input_ids)


def run_variant(name: str, steps: int, backend) -> dict:
    from portable_fsdp.backends.xla import runtime as rt

    config = make_config(VARIANTS[name].overrides)
    world = DEVICES if config.plan.xla_fsdp_v2 else 1
    plan = resolve_plan(config, world)
    state = backend.init(config, plan, "xla")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    ends = data.eos_token_id if config.data.document_masking else None
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, ends)
    evals = eval_batches(data.eval, config.train.eval_batch_size, where.dp_rank, where.dp_size, EVAL_BATCHES, ends)
    result = {"initial_eval": evaluate(backend, state, evals), "names": [n.name for n in state.ctx.named],
              "input_sharding": input_sharding(state, evals[0])}
    losses, compiles, seconds = [], [], []
    for step in range(steps):
        began = time.perf_counter()
        state, metrics = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        seconds.append(time.perf_counter() - began)
        losses.append(metrics["loss"])
        compiles.append(rt.compilations()[0])
    result.update(losses=losses, compiles=compiles, seconds=seconds, shardings=parameter_shardings(state),
                  moment_shardings=moment_shardings(state), memory=backend.memory_report(state),
                  tied=state.ctx.hf_model.lm_head.weight is state.ctx.hf_model.model.embed_tokens.weight)
    if name == "base" and config.plan.xla_fsdp_v2 and DEVICES == 2:
        result.update(sharded_resume(config, plan, backend, steps))
    return result


def sharded_resume(config, plan, backend, steps: int) -> dict:
    """Train half the steps, save SHARDED, train on; then a fresh state loads the save and trains the same
    second half: eval_loss after the load and the second half's losses must be identical."""
    import dataclasses

    half = steps // 2
    plan = dataclasses.replace(plan, state_dict_type=StateDictType.SHARDED_STATE_DICT)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)
    evals = eval_batches(data.eval, config.train.eval_batch_size, 0, 1, EVAL_BATCHES)
    state = backend.init(config, plan, "xla")
    for step in range(half):
        state, _ = backend.train_step(state, batches.micro_batches(step, 0, 1))
    directory = tempfile.mkdtemp(prefix="xla-sharded-")
    backend.save_checkpoint(state, directory)
    saved_eval = evaluate(backend, state, evals)["eval_loss"]
    continued = []
    for step in range(half, steps):
        state, m = backend.train_step(state, batches.micro_batches(step, 0, 1))
        continued.append(m["loss"])
    fresh = backend.init(config, plan, "xla")
    fresh_eval = evaluate(backend, fresh, evals)["eval_loss"]
    fresh = backend.load_checkpoint(fresh, directory, {"step": half, "world_size": DEVICES, "backend": "xla"})
    loaded_eval = evaluate(backend, fresh, evals)["eval_loss"]
    resumed = []
    for step in range(fresh.step, steps):
        fresh, m = backend.train_step(fresh, batches.micro_batches(step, 0, 1))
        resumed.append(m["loss"])
    files = sorted(str(p.relative_to(directory)) for p in pathlib.Path(directory).rglob("*") if p.is_file())
    import shutil

    shutil.rmtree(directory)
    return {"sharded": {"files": files, "saved_eval": saved_eval, "fresh_eval": fresh_eval,
                        "loaded_eval": loaded_eval, "continued": continued, "resumed": resumed}}


def main(out: str, steps: int, names: list) -> None:
    backend = backends.load("xla")
    results = {name: run_variant(name, steps, backend) for name in names}
    pathlib.Path(out).write_text(json.dumps(results))


def _v1_entry(index: int, out: str, steps: int, names: list) -> None:
    main(out, steps, names)


if __name__ == "__main__":
    out_file, n_steps, variant_names = sys.argv[1], int(sys.argv[3]), sys.argv[4:]
    if all(VARIANTS[n].overrides.get("plan.xla_fsdp_v2") == "false" for n in variant_names):
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_v1_entry, args=(out_file, n_steps, variant_names), nprocs=1)
    else:
        main(out_file, n_steps, variant_names)
