"""Run under torchrun (gloo): the GPU fast path's lowering on CPU ranks — compiled layers (plan.compile) and
torchao's float8 layers (plan.float8) as `backends.torch.init` applies them, then N training steps — and write
rank 0's findings to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node W tests/dist/fast_path_check.py OUT.json \
        VARIANT[:STEPS]...

(STEPS: training steps after init, 0 to look at the lowering only.) A float8 variant then saves a FULL checkpoint
in OUT.json's directory, under the variant's name.

The backend is driven directly, past the capability table: float8 is refused on --backend cpu (its matmuls are
emulated there, slower than float32), but torchao 0.14.1's emulation computes what a GPU computes, so the
module selection, the FSDP wrapping and the numbers of the float8 path can be checked here.
"""
import json
import os
import pathlib
import sys

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from portable_fsdp import backends
from portable_fsdp.backends.torch.compile import compiled
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.config.validate import resolve_plan
from tests.parity.matrix import make_config

VARIANTS = {
    "eager": {},
    "compile": {"plan.compile": "true"},
    "compile_checkpointing": {"plan.compile": "true", "plan.activation_checkpointing": "true"},
    # more layers than dynamo's recompilation limit (8): one graph serves every layer
    "compile_12_layers": {"plan.compile": "true", "model.num_hidden_layers": "12"},
    "eager_12_layers": {"model.num_hidden_layers": "12"},
    "float8": {"plan.float8": "true"},
    # the float8 layers swapped in on the meta device of ranks > 0, then filled from rank 0
    "float8_rank0_loading": {"plan.float8": "true", "plan.cpu_ram_efficient_loading": "true"},
    "compile_float8": {"plan.compile": "true", "plan.float8": "true"},
    # the one-GPU benchmark's settings in bf16 (compiled float8 in bf16 is left out: inductor's CPU code for
    # float8 products crashes the process at some shapes in torch 2.9, e.g. 128 rows under bf16 autocast)
    "bf16": {"plan.param_dtype": "bfloat16"},
    "float8_bf16": {"plan.float8": "true", "plan.param_dtype": "bfloat16"},
    "compile_bf16": {"plan.compile": "true", "plan.param_dtype": "bfloat16"},
}


def structure(model) -> dict:
    """What the lowering made of the model: the modules that run compiled, those that are float8 layers, and
    which of them FSDP wraps (names without the checkpoint wrapper's prefix)."""
    def name(n):
        return n.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")

    modules = list(model.named_modules())
    return {"compiled": [name(n) for n, m in modules if compiled(m)],
            "compiled_classes": sorted({type(m).__name__ for _, m in modules if compiled(m)}),
            "fsdp_units": [name(n) for n, m in modules if isinstance(m, FSDPModule)],
            "float8": [name(n) for n, m in modules if type(m).__name__ == "Float8Linear"],
            "parameter_names": [name(n) for n, _ in model.named_parameters()]}


def full(tensor):
    """A parameter's whole value on every rank (a collective for an FSDP shard)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_variant(name: str, steps: int, backend, directory: pathlib.Path) -> dict:
    config = make_config(VARIANTS[name])
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    state = backend.init(config, plan, "cpu")
    found = structure(state.model)
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, config.train.grad_accum_steps, config.seed)
    losses = []
    for step in range(steps):
        state, metrics = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        losses.append(metrics["loss"])
    if "float8" in name:
        found["weight_sums"] = {key: full(value).double().sum().item() for key, value in
                                state.model.named_parameters() if key in ("model.layers.0.self_attn.q_proj.weight",
                                                                          "model.layers.1.mlp.down_proj.weight")}
        if dist.get_rank() == 0:
            (directory / name).mkdir()
        dist.barrier()
        backend.save_checkpoint(state, directory / name)
    return {"losses": losses, **found}


def main(out: str, *variants: str) -> None:
    backend = backends.load("cpu")
    results = {}
    for variant in variants:
        name, _, steps = variant.partition(":")
        results[name] = run_variant(name, int(steps or 0), backend, pathlib.Path(out).parent)
        dist.barrier()
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    backend.finalize()


if __name__ == "__main__":
    main(*sys.argv[1:])
