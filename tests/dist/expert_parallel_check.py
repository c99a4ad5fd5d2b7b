"""Run under torchrun (gloo): train a tiny Mixtral under each named expert-parallel variant for N steps in one
process group, and write rank 0's per-step losses, the eval loss before training and how each rank holds the
experts to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node W tests/dist/expert_parallel_check.py \
        OUT.json STEPS MODELS_DIR VARIANT...

MODELS_DIR holds the tiny models the variants name (tests/dist/test_expert_parallel.py saves them, MODELS):
Mixtral as it ships (`mixtral`), Mixtral and Qwen3-MoE whose configs set output_router_logits (`*_router`:
the router's load-balancing loss is part of the loss).
"""
import dataclasses
import json
import math
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from portable_fsdp import backends
from portable_fsdp.backends.hf_torch.model import create_model
from portable_fsdp.backends.hf_torch.experts import expert_modules
from portable_fsdp.data.batch import EvalBatches
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.training.evaluation import evaluate
from portable_fsdp.config.validate import resolve_plan
from tests.parity.matrix import make_config

EVAL_SEQUENCES = 27  # 3 full eval batches of 8 and one with 3 real rows


@dataclasses.dataclass(frozen=True)
class Variant:
    overrides: dict
    world: int = 2
    model: str = "mixtral_router"  # a directory of MODELS_DIR

    @property
    def bf16(self) -> bool:
        return self.overrides.get("plan.param_dtype") == "bfloat16"


EP2 = {"plan.ep_size": "2"}
VARIANTS = {
    # ep = fsdp: every fsdp rank of the world holds 2 of the 4 experts
    "ep2": Variant(EP2),
    "ep2_no_router_loss": Variant(EP2, model="mixtral"),
    "ep2_checkpointing": Variant({**EP2, "plan.activation_checkpointing": "true"}),
    "ep2_reshard_off": Variant({**EP2, "plan.reshard_after_forward": "false"}),
    "ep2_rank0_loading": Variant({**EP2, "plan.cpu_ram_efficient_loading": "true"}),
    "ep2_cpu_offload": Variant({**EP2, "plan.cpu_offload": "true"}),
    # one process reads the 8 rows at once (the router's loss would be per micro-batch: off)
    "ep2_batch8_accum4": Variant({**EP2, "train.batch_size": "8", "train.grad_accum_steps": "4"}, model="mixtral"),
    "qwen3_moe_ep2": Variant(EP2, model="qwen3_moe_router"),
    "ep2_bf16": Variant({**EP2, "plan.param_dtype": "bfloat16"}),
    # ep < fsdp: ep groups {0, 1} and {2, 3}, each expert sharded again over the 2 ranks holding it
    "fsdp4_ep2": Variant(EP2, world=4),
    "fsdp4_ep2_no_router_loss": Variant(EP2, world=4, model="mixtral"),
    "ep4": Variant({"plan.ep_size": "4"}, world=4),
    # the other axes: sequence shards (cp, sp), replicas (HSDP)
    "fsdp2_cp2_ep2": Variant({**EP2, "plan.cp_size": "2"}, world=4),
    "fsdp2_sp2_ep2": Variant({**EP2, "plan.sp_size": "2"}, world=4),
    "hsdp2_ep2": Variant({**EP2, "plan.dp_replicate_size": "2"}, world=4),
    # tensor parallelism (the model's own plan: attention split over tp): the ep ranks are taken from fsdp × tp,
    # each tp rank dispatching its half of the tokens its tp group shares. ep = tp: the experts split over the
    # tp pair (fsdp 1, or fsdp 2 with each expert sharded again over the 2 fsdp ranks); ep 4 = fsdp 2 × tp 2
    "fsdp1_tp2_ep2": Variant({**EP2, "plan.tp_size": "2"}),
    "fsdp1_tp2_ep2_checkpointing": Variant({**EP2, "plan.tp_size": "2", "plan.activation_checkpointing": "true"}),
    "fsdp1_tp2_ep2_bf16": Variant({**EP2, "plan.tp_size": "2", "plan.param_dtype": "bfloat16"}),
    # 3 rows of 63 tokens: the tp pair's slices are 95 and 94 tokens (gathered padded)
    "fsdp1_tp2_ep2_uneven": Variant({**EP2, "plan.tp_size": "2", "train.batch_size": "3", "data.seq_len": "63"}),
    "qwen3_moe_fsdp1_tp2_ep2": Variant({**EP2, "plan.tp_size": "2"}, model="qwen3_moe_router"),
    "fsdp2_tp2_ep2": Variant({**EP2, "plan.tp_size": "2"}, world=4),
    "fsdp2_tp2_ep4": Variant({"plan.ep_size": "4", "plan.tp_size": "2"}, world=4),
    "qwen3_moe_fsdp2_tp2_ep4": Variant({"plan.ep_size": "4", "plan.tp_size": "2"}, world=4, model="qwen3_moe_router"),
    "hsdp2_tp2_ep2": Variant({**EP2, "plan.tp_size": "2", "plan.dp_replicate_size": "2"}, world=4),
}


def experts_held(model, unsharded: dict) -> dict:
    """How this rank holds the expert weights: on a mesh with an ep dimension, split over its sharded
    dimensions into pieces that make up the weight exactly once, every weight's full value the unsharded
    model's (a collective), and the fraction of the expert weights this rank holds."""
    on_ep_mesh = split_once = equal_to_unsharded = True
    local = total = 0
    experts = expert_modules(model)
    for prefix, module in ((n, m) for n, m in model.named_modules() if m in experts):
        for name, weight in module.named_parameters(recurse=False):
            on_ep_mesh &= isinstance(weight, DTensor) and "ep" in weight.device_mesh.mesh_dim_names
            pieces = math.prod(size for size, placement in zip(weight.device_mesh.mesh.shape, weight.placements)
                               if placement.is_shard())
            split_once &= weight.to_local().numel() * pieces == weight.numel()
            key = f"{prefix}.{name}".replace("_checkpoint_wrapped_module.", "")
            equal_to_unsharded &= torch.equal(weight.full_tensor(), unsharded[key])
            local += weight.to_local().numel()
            total += weight.numel()
    return {"on_ep_mesh": bool(on_ep_mesh), "split_once": bool(split_once), "equal_to_unsharded": bool(equal_to_unsharded),
            "local_fraction": local / total}


def run_variant(name: str, steps: int, models: pathlib.Path, backend) -> dict:
    variant = VARIANTS[name]
    directory = models / variant.model
    config = make_config({**variant.overrides, "model.init_from": str(directory)})
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    state = backend.init(config, plan, "cpu")
    held = experts_held(state.model, create_model(config, rank=0, rank0_only=False).state_dict())
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    evals = EvalBatches(data.eval[:EVAL_SEQUENCES], config.train.eval_batch_size, where.dp_rank, where.dp_size)
    initial_eval = evaluate(backend, state, evals)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed)
    losses = []
    for step in range(steps):
        state, metrics = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        losses.append(metrics["loss"])
    return {"losses": losses, "initial_eval": initial_eval, **held}


def main(out: str, steps: str, models: str, *names: str) -> None:
    backend = backends.load("cpu")
    results = {}
    for name in names:
        results[name] = run_variant(name, int(steps), pathlib.Path(models), backend)
        dist.barrier()
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    backend.finalize()


if __name__ == "__main__":
    main(*sys.argv[1:])
