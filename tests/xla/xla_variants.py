"""Train named variants of the matrix (tests/parity/matrix.py) with the xla backend in one process and write
what the tests check to JSON.

    python tests/xla/xla_variants.py OUT.json DEVICES STEPS VARIANT...

A VARIANT is a name of the matrix, or NAME=JSON with the variant's overrides (e.g. a model family's
directory as model.init_from). DEVICES PJRT CPU devices for SPMD FSDPv2; the variants of one run must all be
SPMD, or all FSDP v1 (then DEVICES is 1), since torch_xla fixes both for the life of a process. Per variant:
per-step losses and compile counts, step times, each parameter's sharding, the shared eval layer's eval_loss
before training and that of the plain-torch model, the sharding annotations of a traced forward; with a
sequence split, predictions against the plain-torch logits; for "base" a SHARDED_STATE_DICT save, reload and
resume; for "tp2" a FULL save resumed with the fsdp layout.
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
import re  # noqa: E402

from portable_fsdp import backends  # noqa: E402
from portable_fsdp.data.batch import EvalBatches  # noqa: E402
from portable_fsdp.data.loader import TrainBatches, build_token_data  # noqa: E402
from portable_fsdp.training.evaluation import evaluate  # noqa: E402
from portable_fsdp.plan import StateDictType  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from tests.parity.matrix import VARIANTS, make_config  # noqa: E402
from tests.parity.reference import reference_losses  # noqa: E402

EVAL_BATCHES = 4
# A Sharding annotation of the traced (not yet partitioned) HLO: the annotated shape and its sharding.
ANNOTATION = re.compile(r"= f32\[([\d,]*)\][^\n]*custom_call_target=\"Sharding\", sharding=(\{[^}]*\})")


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


def plain_torch_eval(config, evals: list) -> tuple:
    """(eval_loss, logits of the first batch) of the unsharded model in plain torch on the host."""
    import torch
    import torch.nn.functional as F

    from portable_fsdp.backends.hf_torch.model import create_model

    model = create_model(config, rank=0, rank0_only=False).eval()
    loss_sum, tokens, first = 0.0, 0, None
    with torch.no_grad():
        for batch in evals:
            positions = None if batch.position_ids is None else torch.from_numpy(batch.position_ids)
            logits = model(input_ids=torch.from_numpy(batch.input_ids), position_ids=positions,
                           use_cache=False).logits.float()
            labels = torch.from_numpy(batch.labels)
            loss_sum += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            tokens += int((labels != -100).sum())
            first = logits if first is None else first
    return loss_sum / tokens, first


def prediction_check(backend, state, batch, plain_logits) -> dict:
    """predict_step's logits, predictions and labels against the plain-torch model's and the batch's own; what
    Trainer's preprocess_logits_for_metrics, handed xla tensors, makes of them."""
    import numpy as np

    out = backend.predict_step(state, batch, return_logits=True)
    preprocessed = backend.predict_step(state, batch, preprocess_logits=lambda logits, labels: logits.argmax(dim=-1))
    return {"shape": list(out["predictions"].shape), "labels_equal": bool(np.array_equal(out["labels"], batch.labels)),
            "max_logit_difference": float(np.abs(out["logits"] - plain_logits.numpy()).max()),
            "predictions_are_argmax": bool(np.array_equal(out["predictions"], out["logits"].argmax(-1))),
            "preprocessed_are_argmax": bool(np.array_equal(preprocessed["logits"], out["predictions"]))}


def forward_annotations(state, batch) -> list:
    """[shape, sharding] of every Sharding annotation in the traced graph of one training forward (read, never
    run): what the lowering asks the XLA partitioner for."""
    import torch
    import torch_xla

    from portable_fsdp.backends.xla.step import _loss_sum, _to_device

    with torch.no_grad():
        loss, _ = _loss_sum(state.ctx, state.model, *_to_device(state.ctx, batch))
    text = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    return [[[int(d) for d in shape.split(",") if d], sharding] for shape, sharding in ANNOTATION.findall(text)]


def variant_config(name: str):
    if "=" in name:
        return make_config(json.loads(name.split("=", 1)[1]))
    return make_config(VARIANTS[name].overrides)


def run_variant(name: str, steps: int, backend) -> dict:
    from portable_fsdp.backends.xla import runtime as rt

    began_variant = time.perf_counter()
    config = variant_config(name)
    world = DEVICES if config.plan.xla_fsdp_v2 else 1
    plan = resolve_plan(config, world)
    state = backend.init(config, plan, "xla")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    ends = data.eos_token_id if config.data.document_masking else None
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, ends)
    evals = EvalBatches(data.eval, config.train.eval_batch_size, where.dp_rank, where.dp_size, EVAL_BATCHES, ends)
    plain_eval, plain_logits = plain_torch_eval(config, evals)
    result = {"initial_eval": evaluate(backend, state, evals), "plain_eval": plain_eval,
              "names": [n.name for n in state.ctx.named], "input_sharding": input_sharding(state, evals[0])}
    if config.plan.xla_fsdp_v2:
        result["annotations"] = forward_annotations(state, batches.micro_batches(0, 0, 1)[0])
    if plan.mesh.sequence_size > 1:
        result["predictions"] = prediction_check(backend, state, evals[0], plain_logits)
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
    result["wall_s"] = time.perf_counter() - began_variant  # initialisation, checks and training
    if (name == "base" and config.plan.xla_fsdp_v2 and DEVICES == 2) or name == "hsdp2x2":
        result.update(sharded_resume(config, plan, backend, steps))
    if name == "tp2":
        result.update(full_resume_without_tp(config, plan, backend, steps))
    return result


def full_resume_without_tp(config, plan, backend, steps: int) -> dict:
    """Train half the steps with tensor parallelism and save FULL_STATE_DICT; a state with the plain fsdp layout
    (tp_size 1, same devices) loads it and trains the second half. Its eval_loss after the load and its losses
    are compared with the saved state's and the single-process reference's."""
    import dataclasses
    import shutil

    half = steps // 2
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)
    evals = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, EVAL_BATCHES)
    state = backend.init(config, plan, "xla")
    for step in range(half):
        state, _ = backend.train_step(state, batches.micro_batches(step, 0, 1))
    directory = tempfile.mkdtemp(prefix="xla-full-")
    backend.save_checkpoint(state, directory)
    saved_eval = evaluate(backend, state, evals)["eval_loss"]
    fsdp_config = make_config({})
    fsdp_plan = dataclasses.replace(plan, mesh=resolve_plan(fsdp_config, DEVICES).mesh)
    fresh = backend.init(fsdp_config, fsdp_plan, "xla")
    fresh = backend.load_checkpoint(fresh, directory, {"step": half, "world_size": DEVICES, "backend": "xla"})
    loaded_eval = evaluate(backend, fresh, evals)["eval_loss"]
    resumed = []
    for step in range(fresh.step, steps):
        fresh, m = backend.train_step(fresh, batches.micro_batches(step, 0, 1))
        resumed.append(m["loss"])
    shutil.rmtree(directory)
    return {"full_resume": {"saved_eval": saved_eval, "loaded_eval": loaded_eval, "resumed": resumed,
                            "reference": reference_losses(config, steps)[half:],
                            "resumed_shardings": parameter_shardings(fresh)}}


def sharded_resume(config, plan, backend, steps: int) -> dict:
    """Train half the steps, save SHARDED, train on; then a fresh state loads the save and trains the same
    second half: eval_loss after the load and the second half's losses must be identical."""
    import dataclasses

    half = steps // 2
    plan = dataclasses.replace(plan, state_dict_type=StateDictType.SHARDED_STATE_DICT)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)
    evals = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, EVAL_BATCHES)
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
    results = {name.split("=", 1)[0]: run_variant(name, steps, backend) for name in names}
    pathlib.Path(out).write_text(json.dumps(results))


def _v1_entry(index: int, out: str, steps: int, names: list) -> None:
    main(out, steps, names)


if __name__ == "__main__":
    out_file, n_steps, variant_names = sys.argv[1], int(sys.argv[3]), sys.argv[4:]
    if all(n in VARIANTS and VARIANTS[n].overrides.get("plan.xla_fsdp_v2") == "false" for n in variant_names):
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_v1_entry, args=(out_file, n_steps, variant_names), nprocs=1)
    else:
        main(out_file, n_steps, variant_names)
