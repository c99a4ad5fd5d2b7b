"""Memory of one training step per device for the Flax lowering, without weights: the model's abstract
parameters (`model.define`, jax.eval_shape underneath), placed by the plan's shardings (`sharding.param_shardings`,
`optimizer_shardings`), and the lowering's own jitted training program (`programs.build`) lowered and compiled
for abstract inputs of the run's shapes. XLA's buffer assignment then says what one device holds:

- parameters, gradients (one float32 copy per parameter shard: every parameter trains) and AdamW's state, each
  the sum of the shard shapes the shardings give;
- the compiled program's memory analysis: its arguments (parameters, optimizer state, the batch), its outputs
  less what aliases the donated arguments, and its temporary buffers — gradients, activations and whatever
  the program keeps alive at its peak.

The program is compiled by the host CPU's XLA (N host devices stand in for the N accelerators): a TPU's or
GPU's compiler fuses and schedules differently, so activations there may differ; the state's shapes do not.
A MoE model's layers trace the target's grouped matmul (for a GPU or TPU, moe.grouped_stand_in: its buffers), and
its report adds the expert FLOPs per token that kernel executes on the target's platform (flops.py).
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from portable_fsdp import placement
from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib, optimizer as optimizer_lib
from portable_fsdp.backends.flax import flops, moe, programs as programs_lib, sharding
from portable_fsdp.backends.flax.step import COMPUTE_DTYPES
from portable_fsdp.backends.hf_torch.model import hf_config
from portable_fsdp.config.schema import from_dict
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.config.validate import resolve_plan


METHOD = "the jitted training step compiled for abstract inputs on host CPU devices (XLA's memory analysis)"


def estimate_memory(request: dict) -> dict:
    """The backend contract's estimate (portable_fsdp/backend.py): one device stands for all."""
    began = time.perf_counter()
    world_size = request["world"]
    config = from_dict(request["config"])
    plan = resolve_plan(config, world_size)
    info = architecture.describe_model(config)
    arch = architecture.from_hf_config(hf_config(config.model))
    model_def = model_lib.define(arch, remat=plan.activation_checkpointing or config.train.gradient_checkpointing)
    mesh = sharding.build_mesh(plan.mesh, jax.devices()[:world_size])
    expert_axes = placement.expert_axes(plan.mesh)
    param_sharding = sharding.param_shardings(model_def.shapes, mesh, tensor_parallel_plan(plan, info),
                                              torch_weights.torch_name, expert_axes)
    params = {name: _abstract(shape, param_sharding[name]) for name, shape in model_def.shapes.items()}
    optimizer = optimizer_lib.build(config.train)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_sharding = sharding.optimizer_shardings(opt_shapes, model_def.shapes, param_sharding, mesh)
    opt_state = jax.tree.map(_abstract, opt_shapes, opt_sharding)
    programs = programs_lib.build(model_def, optimizer, mesh, param_sharding, opt_sharding,
                                  COMPUTE_DTYPES[plan.mixed_precision.param_dtype], config.train.loss_chunk_tokens,
                                  expert_axes, platform=request["device"])
    t = config.train
    stacked = sharding.batch_sharding(mesh, leading_axes=1)
    rows = t.batch_size // t.grad_accum_steps
    tokens = jax.ShapeDtypeStruct((t.grad_accum_steps, rows, config.data.seq_len), jnp.int32, sharding=stacked)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(mesh))
    compiled = programs.train.lower(params, opt_state, tokens, tokens, tokens, scalar, scalar).compile()
    memory = compiled.memory_analysis()
    parameters = _bytes_per_device(params.values())
    held = {"parameters": parameters, "gradients": parameters,
            "optimizer": _bytes_per_device(jax.tree.leaves(opt_state))}
    program = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
               "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes}
    peak = program["arguments"] + program["temporaries"] + max(0, program["outputs"] - program["aliased"])
    at_peak = {"parameters": held["parameters"], "optimizer": held["optimizer"],
               "gradients": min(held["gradients"], program["temporaries"]),
               "program_temporaries": max(0, program["temporaries"] - held["gradients"]),
               "inputs": max(0, program["arguments"] - held["parameters"] - held["optimizer"]),
               "outputs": max(0, program["outputs"] - program["aliased"])}
    tokens = rows * config.data.seq_len // (plan.mesh.data_parallel_size * plan.mesh.sequence_size)
    result = {"ranks": [{"rank": 0, "peak": peak, "at_peak": at_peak, "held": held, "program": program,
                         "micro_batch_rows": rows // plan.mesh.data_parallel_size, "tokens_per_rank": tokens,
                         "cpu_offload": False, "seconds": time.perf_counter() - began}],
              "model": dataclasses.asdict(info), "method": METHOD,
              "same_on_every_device": True}
    if arch.num_experts:
        executed = flops.expert_flops_per_token(arch, tokens, request["device"], moe.expert_groups(mesh, expert_axes))
        result["expert_flops_per_token"] = dataclasses.asdict(executed)
    return result


def _abstract(shape, placed) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=placed)


def _bytes_per_device(leaves) -> int:
    """Bytes device 0 holds of these abstract arrays (every device holds shards of the same shapes)."""
    total = 0
    for leaf in leaves:
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total
