"""Run under torchrun with one process: the torch backend in a world of one rank, for each case of CASES —
what its model and optimizer are (plain tensors, no FSDP2 module), its per-step losses, first gradients,
eval_loss and predictions at init, memory report, and FULL and SHARDED checkpoint round trips — to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/dist/single_rank_check.py \
        OUT.json STEPS CASE...
"""
import dataclasses
import json
import sys
import tempfile

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from portable_fsdp import backends
from portable_fsdp.data.batch import EvalBatches
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.training.evaluation import evaluate
from portable_fsdp.plan import StateDictType
from portable_fsdp.config.validate import resolve_plan
from tests.dist.fsdp_variants import EVAL_SEQUENCES, gradient_deviation, sharded_round_trip
from tests.parity.matrix import make_config

CHECKPOINTING = {"plan.activation_checkpointing": "true"}
CASES = {
    "plain": {},
    "activation_checkpointing": CHECKPOINTING,
    "bf16": {"plan.param_dtype": "bfloat16"},
    "cpu_offload": {"plan.cpu_offload": "true"},
    "tied_rank0_loading": {"model.tie_word_embeddings": "true", "plan.cpu_ram_efficient_loading": "true"},
    "accum4_unchunked_loss": {"train.batch_size": "8", "train.grad_accum_steps": "4", "train.loss_chunk_tokens": "0"},
}


def what_it_trains(state) -> dict:
    model = state.model
    parameters = list(model.parameters())
    optimized = [p for group in state.optimizer.param_groups for p in group["params"]]
    return {"fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "dtensors": sum(isinstance(p, DTensor) for p in parameters),
            "optimizer_holds_the_parameters": ({id(p) for p in optimized}
                                               == {id(p) for p in parameters if p.requires_grad}),
            "checkpoint_wrappers": sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def full_round_trip(config, plan, backend, state, evals) -> dict:
    """Save FULL (model.safetensors), load it into a fresh plain model: eval_loss must not change."""
    before = evaluate(backend, state, evals)["eval_loss"]
    directory = tempfile.mkdtemp()
    backend.save_checkpoint(state, directory)
    fresh = backend.init(config, plan, "cpu")
    fresh = backend.load_checkpoint(fresh, directory, {"step": state.step, "world_size": 1})
    return {"full_eval_before": before, "full_eval_after": evaluate(backend, fresh, evals)["eval_loss"]}


def run_case(overrides: dict, steps: int, backend) -> dict:
    config = make_config(overrides)
    plan = resolve_plan(config, 1)
    state = backend.init(config, plan, "cpu")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    evals = EvalBatches(data.eval[:EVAL_SEQUENCES], config.train.eval_batch_size, 0, 1)
    result = {"initial_eval": evaluate(backend, state, evals), **gradient_deviation(config, state, batches, where)}
    result["first_predictions"] = backend.predict_step(state, evals[0])["predictions"].tolist()
    losses = []
    for step in range(steps):
        state, metrics = backend.train_step(state, batches.micro_batches(step, 0, 1))
        losses.append(metrics["loss"])
    result.update(losses=losses, memory=backend.memory_report(state), **what_it_trains(state))
    few = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, 4)
    result.update(full_round_trip(config, plan, backend, state, few))
    sharded_plan = dataclasses.replace(plan, state_dict_type=StateDictType.SHARDED_STATE_DICT)
    result.update(sharded_round_trip(config, sharded_plan, backend, state, data, where))
    return result


def main() -> None:
    out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    backend = backends.load("cpu")
    results = {name: run_case(CASES[name], steps, backend) for name in names}
    with open(out, "w") as f:
        json.dump(results, f)
    backend.finalize()


if __name__ == "__main__":
    main()
