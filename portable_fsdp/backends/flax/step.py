"""The functional surface of the Flax lowering that the neutral loop drives (protocol: portable_fsdp/backend.py).

One process drives every device of the mesh, so it reads the whole global batch (placement: dp_size 1)
and the jitted programs split it over the devices: rows over dp_replicate × fsdp, the sequence over cp or sp,
parameters as sharding.py places them (tp and ep included). The initial
weights are the torch backends' (the same seeded transformers model, converted), placed one parameter at a time
from the model built on the meta device (initial.py). Losses are
Σ token losses / Σ label tokens of the whole accumulated batch, counted on the host before any split.

On several machines (one JAX process each, `jax.process_count() > 1`) the mesh spans every machine's
devices and each process reads its own rows of the global batch (processes.py): label tokens are summed
over processes, and eval and predict results are global on every process.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from portable_fsdp.backends.flax import (description, devices as devices_lib, initial, model as model_lib,
                                         optimizer as optimizer_lib, processes, programs as programs_lib,
                                         resources, sharding, user_model)
from portable_fsdp.data.batch import Batch
from portable_fsdp.errors import require_finite
from portable_fsdp.backend import ModelInfo, Placement
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.placement import expert_axes
from portable_fsdp.errors import UserError
from portable_fsdp.plan import ShardingPlan
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts
from portable_fsdp.training.schedule import for_config as schedule_for

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Context:
    """What a step needs besides the parameters and optimizer state."""

    config: object
    plan: ShardingPlan
    info: ModelInfo
    hf_config: object  # the transformers config, written into FULL checkpoints
    torch_names: tuple  # the torch state-dict order, for checkpoints in torch's layout
    model_def: model_lib.ModelDef
    mesh: object
    param_sharding: dict
    opt_sharding: object
    programs: programs_lib.Programs
    schedule: object  # step -> learning rate: the config's, or the user's
    baseline_mb: tuple = ()  # per device of the mesh: its memory before the model existed (resources.py)
    # FULL checkpoints hold the optimizer's state as torch's AdamW state dict (the built-in model and AdamW), else
    # as the optax state's own arrays (a user's model or optimizer; checkpoint.py)
    torch_optimizer_state: bool = True


@dataclasses.dataclass
class TrainState:
    params: dict  # flax name -> jax.Array, sharded as the plan says
    opt_state: object
    step: int
    ctx: Context


def init(config, plan: ShardingPlan, backend: str, parts: Parts = NO_PARTS) -> TrainState:
    """`parts`: a flax.nnx module, a loss, an optax transformation and a schedule of the user's own, each in
    place of the config's (portable_fsdp/training/parts.py)."""
    remat = plan.activation_checkpointing or config.train.gradient_checkpointing
    _check_parts(parts, remat)
    devices = devices_lib.take(plan.mesh.data_parallel_size * plan.mesh.sequence_size * plan.mesh.tp_size)
    if plan.mixed_precision.param_dtype == "float32":
        # float32 means float32: a GPU would otherwise multiply in TF32, a TPU in one bfloat16 pass
        jax.config.update("jax_default_matmul_precision", "highest")
    mesh = sharding.build_mesh(plan.mesh, devices)
    baseline_mb = tuple(resources.device_memory_mb(device)["mem_mb"] for device in resources.reported_devices(mesh))
    weights = initial.prepare(config, remat) if parts.model is None else user_model.prepare(parts.model)
    model_def, hf_config, torch_names = weights.model_def, weights.hf_config, weights.torch_names
    info = description.describe_model(config, parts)
    experts_over = expert_axes(plan.mesh)
    param_sharding = sharding.param_shardings(model_def.shapes, mesh, tensor_parallel_plan(plan, info),
                                              model_def.plan_name, experts_over)
    params = weights.place(param_sharding)
    del weights  # a model built whole (initial.built_whole) leaves the host here
    optimizer = optimizer_lib.build(config.train, parts.optimizer)
    abstract_opt_state = jax.eval_shape(optimizer.init, params)
    optimizer_lib.check_learning_rate(abstract_opt_state)
    opt_sharding = sharding.optimizer_shardings(abstract_opt_state, model_def.shapes, param_sharding, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sharding)(params)
    compute_dtype = COMPUTE_DTYPES[plan.mixed_precision.param_dtype]
    # A chunked loss projects the built-in model's hidden states itself: a user's model or loss sees whole logits.
    chunk_tokens = config.train.loss_chunk_tokens if parts.model is None and parts.loss is None else 0
    programs = programs_lib.build(model_def, optimizer, mesh, param_sharding, opt_sharding, compute_dtype,
                                  chunk_tokens, experts_over, parts.loss)
    ctx = Context(config, plan, info, hf_config, torch_names, model_def, mesh, param_sharding, opt_sharding, programs,
                  parts.schedule or schedule_for(config.train), baseline_mb,
                  torch_optimizer_state=parts.model is None and parts.optimizer is None)
    return TrainState(params, opt_state, 0, ctx)


def _check_parts(parts: Parts, remat: bool) -> None:
    """What this backend cannot do with a user's parts, refused before any device work."""
    if parts.model is not None:
        user_model.check_module(parts.model)
        if remat:
            raise UserError("plan.activation_checkpointing", (
                "--backend flax does not rematerialise the layers of a flax.nnx model of your own; set it (and "
                "train.gradient_checkpointing) to false, or wrap the model's layers with nnx.remat yourself"))
    if parts.optimizer is not None:
        optimizer_lib.check_own(parts.optimizer)


def _positions(batch: Batch) -> np.ndarray:
    if batch.position_ids is not None:
        return batch.position_ids
    return np.broadcast_to(np.arange(batch.input_ids.shape[1]), batch.input_ids.shape)


def _on_devices(arrays: list, mesh, leading_axes: int) -> list:
    target = sharding.batch_sharding(mesh, leading_axes)
    put = processes.to_global if processes.several() else jax.device_put  # several: this process's rows
    return [put(np.ascontiguousarray(a, dtype=np.int32), target) for a in arrays]


def train_step(state: TrainState, micro_batches: list) -> tuple:
    ctx = state.ctx
    tokens = sum(b.num_label_tokens for b in micro_batches)
    if processes.several():
        tokens = processes.total(tokens)
    stacked = [np.stack(parts) for parts in zip(*[(b.input_ids, b.labels, _positions(b)) for b in micro_batches])]
    lr = float(ctx.schedule(state.step))
    params, opt_state, out = ctx.programs.train(state.params, state.opt_state, *_on_devices(stacked, ctx.mesh, 1),
                                                jnp.float32(max(tokens, 1)), jnp.float32(lr))
    # Σ token losses / label tokens (a user's loss: Σ sum / Σ count); MoE: + its load-balancing loss
    loss = float(out["loss_sum"]) / float(out["count"]) + float(out["router_loss"])
    grad_norm, finite = float(out["grad_norm"]), bool(out["finite"])
    require_finite(state.step + 1, loss, grad_norm, ctx.config.train.nonfinite)  # the program already skipped it
    metrics = {"loss": loss, "tokens": int(tokens), "grad_norm": grad_norm, "lr": lr, "skipped": not finite}
    return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), metrics


def count_label_tokens(state: TrainState, batch: Batch) -> int:
    """num_items_in_batch: this process reads the whole global batch, before any sharding (several processes:
    the sum of their rows')."""
    return processes.total(batch.num_label_tokens) if processes.several() else batch.num_label_tokens


def eval_step(state: TrainState, batch: Batch, num_items_in_batch: int) -> dict:
    """{"loss_sum": Σ token losses of the global batch}; the eval layer divides by Σ num_items_in_batch (a user's
    loss: also its Σ "count", which the eval layer divides by instead)."""
    arrays = _on_devices([batch.input_ids, batch.labels, _positions(batch)], state.ctx.mesh, 0)
    return {key: float(value) for key, value in state.ctx.programs.eval_loss_sum(state.params, *arrays).items()}


def predict_step(state: TrainState, batch: Batch, return_logits: bool = False, preprocess_logits=None) -> dict:
    """Argmax predictions of the global batch (and its labels), full length, in order, as numpy
    (`preprocess_logits`: the contract's, on this process's rows as jax arrays)."""
    input_ids, positions = _on_devices([batch.input_ids, _positions(batch)], state.ctx.mesh, 0)
    out = state.ctx.programs.predict(state.params, input_ids, positions,
                                     return_logits or preprocess_logits is not None)
    if preprocess_logits is not None:
        labels = None if batch.labels is None else _on_devices([batch.labels], state.ctx.mesh, 0)[0]
        out["logits"] = preprocess_logits(out["logits"], labels)
    several = processes.several()
    out = processes.gather(out) if several else {k: np.asarray(v) for k, v in out.items()}
    out["predictions"] = out["predictions"].astype(np.int64)
    if batch.labels is not None:
        out["labels"] = processes.gather(batch.labels) if several else batch.labels
    return out


def placement(state: TrainState) -> Placement:
    world_size = state.ctx.mesh.devices.size
    if processes.several():
        dp_rank, dp_size = processes.data_slice(state.ctx.mesh)
        return Placement(rank=jax.process_index(), world_size=world_size, dp_rank=dp_rank, dp_size=dp_size,
                         process_count=jax.process_count())
    return Placement(rank=0, world_size=world_size, dp_rank=0, dp_size=1, process_count=1)


def barrier(state: TrainState, timeout_s: float | None = None) -> None:
    """One process: nothing to wait for (device work is awaited where results are read). Several: a device
    all-reduce, which train.collective_timeout_s does not bound (`timeout_s` has nothing to lengthen)."""
    if processes.several():
        processes.barrier()


def any_rank(state: TrainState, flag: bool) -> bool:
    """One process sees every signal itself: nothing to agree on (several: whether any process saw it)."""
    return processes.anyone(flag) if processes.several() else flag


def model_info(state: TrainState) -> ModelInfo:
    return state.ctx.info


def finalize(state: TrainState | None = None) -> None:
    """Nothing to tear down on one process: device buffers go with it. Several leave jax.distributed together."""
    if processes.several():
        jax.distributed.shutdown()
