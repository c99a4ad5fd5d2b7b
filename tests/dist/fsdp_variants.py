"""Run under torchrun (gloo): train each named variant of the matrix (tests/parity/matrix.py) for N steps in one
process group and write rank 0's per-step losses, the sharding it observed, how far its first gradients are
from one process's and a SHARDED checkpoint round-trip to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/fsdp_variants.py OUT.json STEPS V...
"""
import dataclasses
import hashlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from portable_fsdp import backends
from portable_fsdp.backends.torch import step as torch_step
from portable_fsdp.data.batch import EvalBatches
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.training.evaluation import evaluate
from portable_fsdp.config.validate import resolve_plan
from tests.parity.matrix import VARIANTS, make_config
from tests.parity.reference import reference_gradients
from tests.dist.launch import write_results

# 3 full eval batches of 8 and one with 3 real rows: ranks see different numbers of label tokens.
EVAL_SEQUENCES = 27


def local_fraction(model) -> float:
    """Elements this rank holds / elements of the model (1/N when truly sharded)."""
    mine = total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            mine += p.to_local().numel()
        else:
            mine += p.numel()
        total += p.numel()
    return mine / total


def tp_sharded_fraction(model) -> float:
    """Elements of the parameters split over the tp mesh dimension / elements of the model."""
    split = total = 0
    for p in model.parameters():
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        if "tp" in names and p.placements[names.index("tp")].is_shard():
            split += p.numel()
        total += p.numel()
    return split / total


def gradient_deviation(config, state, batches, where) -> dict:
    """Step 0's gradients (gathered whole) and their global norm as the backend computes them, against one
    process's on the same global batch: the largest |g - g_ref| / |g_ref| (L2, per parameter). Leaves the
    gradients zeroed and the weights as they were."""
    torch_step.compute_gradients(state, batches.micro_batches(0, where.dp_rank, where.dp_size))
    norm = torch_step.clip_grad_norm(state.model, 0.0, state.ctx.runtime.device)
    grads = {}
    for name, p in state.model.named_parameters():  # every rank gathers, in the same order
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = grad.float().cpu()
    state.optimizer.zero_grad(set_to_none=True)
    if dist.get_rank() != 0:
        return {}
    one_batch = TrainBatches(batches.sequences, batches.global_batch, 1, batches.seed, batches.documents_end_at)
    (whole,) = one_batch.micro_batches(0, 0, 1)  # one process reads the whole step as one batch
    reference = reference_gradients(config, whole)
    worst = max(float(torch.linalg.vector_norm(grads[n] - g) / torch.linalg.vector_norm(g))
                for n, g in reference.items() if n is not None)
    assert set(grads) == {n for n in reference if n is not None}, sorted(set(grads) ^ set(reference))
    return {"gradient_deviation": worst, "grad_norm": norm, "reference_grad_norm": reference[None]}


def run_variant(name: str, steps: int, backend) -> dict:
    config = make_config(VARIANTS[name].overrides)
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    state = backend.init(config, plan, "cpu")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    ends = data.eos_token_id if config.data.document_masking else None
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, ends)
    evals = EvalBatches(data.eval[:EVAL_SEQUENCES], config.train.eval_batch_size, where.dp_rank, where.dp_size,
                         documents_end_at=ends)
    initial_eval = evaluate(backend, state, evals)
    gradients = gradient_deviation(config, state, batches, where)
    sharded_after_eval = all(isinstance(p, DTensor) for p in state.model.parameters())
    first_predictions = backend.predict_step(state, evals[0])
    unlabeled = backend.predict_step(state, dataclasses.replace(evals[0], labels=None))
    sharded_after_eval &= all(isinstance(p, DTensor) for p in state.model.parameters())
    losses = []
    for step in range(steps):
        state, metrics = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        losses.append(metrics["loss"])
    result = {"losses": losses, "local_fraction": local_fraction(state.model),
              "initial_eval": initial_eval, "first_predictions": first_predictions["predictions"].tolist(),
              "unlabeled_predictions_match": bool((unlabeled["predictions"] == first_predictions["predictions"]).all()),
              "all_dtensor": all(isinstance(p, DTensor) for p in state.model.parameters()),
              "sharded_after_eval": sharded_after_eval,
              "tied": state.model.lm_head.weight is state.model.model.embed_tokens.weight,
              "tp_sharded_fraction": tp_sharded_fraction(state.model), **gradients}
    if name == "base" or max(plan.mesh.tp_size, plan.mesh.sp_size, plan.mesh.dp_replicate_size) > 1:
        result.update(sharded_round_trip(config, plan, backend, state, data, where))
    return result


def sharded_round_trip(config, plan, backend, state, data, where) -> dict:
    """Save SHARDED, load into a freshly initialised FSDP2 model: eval_loss must not change. The load is told of no
    backend, as a resume from another backend or world size: each rank then starts a random stream of its own
    (`rng_after_load`: a digest of each rank's state), except that a tp group's ranks must share theirs."""
    from portable_fsdp.plan import StateDictType

    evals = EvalBatches(data.eval, config.train.eval_batch_size, where.dp_rank, where.dp_size, 4)
    before = evaluate(backend, state, evals)["eval_loss"]
    sharded_plan = dataclasses.replace(plan, state_dict_type=StateDictType.SHARDED_STATE_DICT)
    state = dataclasses.replace(state, ctx=dataclasses.replace(state.ctx, plan=sharded_plan))
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    backend.save_checkpoint(state, directory[0])
    dist.barrier()
    fresh = backend.init(config, sharded_plan, "cpu")
    fresh_loss = evaluate(backend, fresh, evals)["eval_loss"]
    fresh = backend.load_checkpoint(fresh, directory[0], {"step": state.step, "world_size": dist.get_world_size()})
    after = evaluate(backend, fresh, evals)["eval_loss"]
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
    return {"sharded_eval_before": before, "sharded_eval_after": after, "fresh_eval": fresh_loss,
            "sharded_files": sorted(os.listdir(os.path.join(directory[0], "sharded"))), "rng_after_load": digests}


def main() -> None:
    out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    backend = backends.load("cpu")
    results = {name: run_variant(name, steps, backend) for name in names}
    write_results(out, results)
    backend.finalize()


if __name__ == "__main__":
    main()
