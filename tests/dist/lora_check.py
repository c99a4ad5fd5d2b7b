"""Run under torchrun (gloo): train the test recipe with LoRA adapters (model.peft) on FSDP2 and write rank 0's
per-step losses, which parameters got gradients and which are in the optimizer's state, and the same run's losses
on one process (the plain transformers model with the same adapters, torch's AdamW) to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/lora_check.py OUT.json STEPS CASE...

Cases: `meta` (every rank builds the model on the meta device and fills its shards), `rank0`
(plan.cpu_ram_efficient_loading: rank 0 builds it whole and broadcasts).
"""
import os
import sys

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from portable_fsdp.backends.hf_torch import adapters, model as model_lib
from portable_fsdp.backends.torch import step as torch_step
from portable_fsdp.config.validate import resolve_plan
from portable_fsdp.data.loader import TrainBatches, build_token_data
from tests.dist.launch import write_results
from tests.parity.matrix import make_config
from tests.parity.reference import reference_losses

LORA = {"model.peft.type": "lora", "model.peft.r": "4", "model.peft.target_modules": "q_proj,v_proj,down_proj"}


def one_process_model(config):
    """The unsharded model with the adapters the lowering starts from."""
    model = model_lib.create_model(config, rank=0, rank0_only=False)
    adapters.add(model, config.model.peft)
    adapters.initialize(model, config.seed, lambda param, full: param.copy_(full))
    return model


CASES = {"meta": {}, "rank0": {"plan.cpu_ram_efficient_loading": "true"}}


def run_case(name: str, steps: int) -> dict:
    config = make_config({**LORA, **CASES[name]})
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    state = torch_step.init(config, plan, "cpu")
    where = torch_step.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed, None)
    torch_step.compute_gradients(state, batches.micro_batches(0, where.dp_rank, where.dp_size))
    with_gradients = sorted(n for n, p in state.model.named_parameters() if p.grad is not None)
    state.optimizer.zero_grad(set_to_none=True)
    losses, names = [], {id(p): n for n, p in state.model.named_parameters()}
    for step in range(steps):
        state, metrics = torch_step.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        losses.append(metrics["loss"])
    result = {"losses": losses, "with_gradients": with_gradients,
              "optimizer_state": sorted(names[id(p)] for p in state.optimizer.state),
              "parameters": [n for n, _ in state.model.named_parameters()],
              "sharded": all(isinstance(p, DTensor) for p in state.model.parameters())}
    if dist.get_rank() == 0:
        result["reference"] = reference_losses(config, steps, model=one_process_model(config))
    return result


def main() -> None:
    out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    write_results(out, {name: run_case(name, steps) for name in names})
    torch_step.finalize()


if __name__ == "__main__":
    main()
