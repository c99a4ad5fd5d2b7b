"""The torch_xla lowering's side of the backend contract (the `Backend` Protocol in portable_fsdp/backend.py):
start-up, the training and evaluation steps, and what the loop asks of a running state.

Numerics are the torch backend's: loss = Σ token losses / Σ label tokens of the whole accumulated batch,
AdamW with decay on >= 2-D parameters, the schedule's lr set each step, global-norm clipping. A step is two
graphs, each compiled once: forward + backward + clipping, then (once the loss and norm are read back and
found finite) the update. Everything else stays on the device. A user's parts (SPMD only) are the torch
backend's: a loss's count summed on the device, the gradients divided by it once before clipping.
"""
from __future__ import annotations

import contextlib
import dataclasses

import warnings

import torch
import torch_xla.core.xla_model as xm
from torch import nn

from portable_fsdp.backends.hf_torch import chunked_loss, custom_model
from portable_fsdp.backends.hf_torch.custom_model import logits_of
from portable_fsdp.backends.hf_torch.loss import Objective, RouterLoss, accumulate_gradients, divide_gradients
from portable_fsdp.backends.hf_torch.model import (create_model, create_on_meta, describe_model,
                                                  enable_gradient_checkpointing, freeze_parameters)
from portable_fsdp.backends.hf_torch.optimizer import apply_update, learning_rates
from portable_fsdp.backends.xla import fsdp_settings, moe, optimizer as optim, params as params_lib
from portable_fsdp.backends.xla import resources, runtime as rt
from portable_fsdp.backends.xla.parallelize import parallelize
from portable_fsdp.data.batch import IGNORE_INDEX, Batch
from portable_fsdp.backend import ModelInfo, Placement
from portable_fsdp.training.loss_chunks import Chunking
from portable_fsdp.errors import UserError
from portable_fsdp.plan import ShardingPlan, StateDictType
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts


@dataclasses.dataclass(frozen=True)
class Context:
    """What a step needs besides the mutable model and optimizer."""

    runtime: rt.Runtime
    plan: ShardingPlan
    config: object
    info: ModelInfo
    schedule: object
    hf_model: nn.Module  # the transformers model inside the wrappers: its config and save_pretrained
    named: tuple  # params.NamedParameter per parameter, in checkpoint names
    baseline_mb: float = 0.0  # memory before the model existed (libraries, runtime): host RSS on CPU, HBM on a TPU
    objective: Objective = Objective()  # the model's call and the loss (the user's, when passed in)
    own_optimizer: bool = False  # a user's factory made it: its state is in no checkpoint

    @property
    def autocast_dtype(self):
        """SPMD mixed precision is torch_xla's autocast (FSDP v1 casts through its compute_dtype)."""
        dtype = self.plan.mixed_precision.param_dtype
        return getattr(torch, dtype) if self.runtime.spmd and dtype != "float32" else None


@dataclasses.dataclass
class TrainState:
    model: nn.Module  # the root FSDP wrapper
    optimizer: torch.optim.Optimizer
    step: int
    ctx: Context


def init(config, plan: ShardingPlan, backend: str, parts: Parts = NO_PARTS) -> TrainState:
    """`parts`: the user's model, loss, optimizer factory and schedule, each in place of the config's (SPMD)."""
    fsdp_settings.refuse_parts_under_v1(plan, parts.given())
    if parts.model is not None:
        custom_model.check_run(parts.model, config, plan)
    if parts.optimizer is not None:
        _check_optimizer_state(plan)
    runtime = rt.initialize(plan, config.train.collective_timeout_s)
    if plan.mixed_precision.param_dtype == "float32" and runtime.device_type != "CPU":
        # float32 means float32: a TPU otherwise multiplies float32 operands in one bfloat16 pass
        import torch_xla.backends

        torch_xla.backends.set_mat_mul_precision("highest")
    local_devices = runtime.world_size // runtime.process_count if runtime.spmd else 1
    baseline_mb = resources.memory_mb(runtime.spmd, runtime.device_type, local_devices, runtime.device)[0]["mem_mb"]
    v1_kwargs = {} if runtime.spmd else fsdp_settings.v1_kwargs(
        plan, plan.xla.xla_fsdp_settings, fsdp_settings.v1_signature(), config.train.weight_decay)
    info = describe_model(config, parts)
    layer_classes = plan.wrap_classes(info)
    model, on_meta = _build_model(config, runtime, parts)
    freeze_parameters(model, config.train.freeze)
    if config.train.gradient_checkpointing:
        from torch_xla.utils.checkpoint import checkpoint  # behind XLA's optimization barrier

        enable_gradient_checkpointing(model, checkpoint)
    root = parallelize(model, plan, runtime, info, layer_classes, v1_kwargs, on_meta)
    # Under SPMD the program is global: a chunk spans the rows and sequence parts of every device.
    spmd = {"sequence_parts": plan.mesh.sequence_size, "row_shards": plan.mesh.data_parallel_size} if runtime.spmd else {}
    objective = Objective(custom_model.Forward.of(parts.model) if parts.model is not None else None, parts.loss)
    if objective == Objective():  # a user's loss reads the logits; a user's model has no transformers lm_head
        chunked_loss.install(model, Chunking(config.train.loss_chunk_tokens, **spmd), "xla")
    named = tuple(params_lib.named_parameters(root, runtime.spmd))
    optimizer = optim.build_optimizer(named, config.train, parts.optimizer)
    if parts.optimizer is None and config.train.optimizer == "adamw":  # the others create their state in the first
        optim.prime_state(optimizer)  # step (one more compilation)
    rt.sync()
    ctx = Context(runtime, plan, config, info, learning_rates(parts, config.train), model, named,
                  baseline_mb=baseline_mb, objective=objective, own_optimizer=parts.optimizer is not None)
    return TrainState(root, optimizer, 0, ctx)


def _build_model(config, runtime: rt.Runtime, parts: Parts) -> tuple:
    """(the model, its deferred_init.OnMeta when it is filled as it is sharded, else None). SPMD: the model on the
    meta device, each parameter filled into its shards in turn (parallelize), so the host never holds it whole;
    FSDP v1 (one process per device) builds the seeded model whole in each process. A user's module is taken as
    given, built or on the meta device (then initialised by its own init, seeded by train.seed)."""
    if parts.model is not None:
        return parts.model, custom_model.on_meta(parts.model, config.seed)
    on_meta = create_on_meta(config) if runtime.spmd else None
    model = on_meta.model if on_meta else create_model(config, rank=0, rank0_only=False)
    moe.prepare(model)  # experts that XLA compiles, and a histc PJRT CPU runs (portable_fsdp/backends/xla/moe.py)
    return model, on_meta


def _check_optimizer_state(plan: ShardingPlan) -> None:
    """xla's checkpoints keep AdamW's state only (its moments, placed like their parameters): a user's optimizer
    resumes its weights and step from a FULL checkpoint, its state afresh; a SHARDED one would not load."""
    if plan.state_dict_type == StateDictType.SHARDED_STATE_DICT:
        raise UserError("plan.state_dict_type", ("SHARDED_STATE_DICT on xla holds AdamW's moments only, not an "
                                                 "optimizer passed in: save FULL_STATE_DICT (its state then restarts "
                                                 "on resume)"))
    warnings.warn("optimizer: xla's FULL checkpoints hold AdamW's state only: a resume restores the weights and the "
                  "step, and this optimizer's state starts afresh", stacklevel=3)


def _to_device(ctx: Context, batch: Batch) -> tuple:
    """(input_ids, labels or None, position_ids or None) on the device, sharded by row under SPMD."""
    arrays = [batch.input_ids] + [a for a in (batch.labels, batch.position_ids) if a is not None]
    tensors = iter(rt.to_device(ctx.runtime, arrays))
    input_ids = next(tensors)
    labels = next(tensors) if batch.labels is not None else None
    positions = next(tensors) if batch.position_ids is not None else None
    return input_ids, labels, positions


def _autocast(ctx: Context):
    dtype = ctx.autocast_dtype
    return torch.autocast("xla", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _loss_sum(ctx: Context, model, input_ids, labels, positions, router: RouterLoss | None = None) -> tuple:
    """(Σ loss over these tokens, their count or None: the built-in loss), device tensors."""
    with _autocast(ctx):
        return ctx.objective(model, input_ids, labels, positions, router)


def train_step(state: TrainState, micro_batches: list) -> tuple:
    ctx, model, runtime = state.ctx, state.model, state.ctx.runtime
    model.train()
    inputs = [_to_device(ctx, b) for b in micro_batches]
    tokens = rt.device_sum(runtime, sum((labels != IGNORE_INDEX).sum() for _, labels, _ in inputs))
    counts_itself = ctx.objective.loss is not None  # a user's loss: its count is known after the forward
    # XlaFullyShardedDataParallel averages gradients over its processes: scale so they sum instead.
    scale = 1 if counts_itself else (1 if runtime.spmd else runtime.world_size) / tokens.clamp(min=1)

    # a MoE router's load-balancing loss (output_router_logits) over the whole batch, weighed as the model does;
    # under SPMD a micro-batch's router logits are already every device's rows
    router = None if counts_itself else RouterLoss(tokens / len(inputs), lambda t: rt.device_sum(runtime, t))

    @contextlib.contextmanager
    def forward(index: int, micro_batch: tuple):
        yield _loss_sum(ctx, model, *micro_batch, router)
        if index < len(inputs) - 1:
            rt.sync()  # one graph per micro-batch keeps graphs small and their number bounded

    loss_sum, count = accumulate_gradients(inputs, forward, scale, rank=runtime.rank, step=state.step + 1,
                                           sum_dtype=torch.float32)
    if counts_itself:
        count = rt.device_sum(runtime, count)
        count = torch.where(count == 0, torch.ones_like(count), count)
        divide_gradients([n.param for n in ctx.named], count)
    loss = rt.device_sum(runtime, loss_sum) / (count if counts_itself else tokens.clamp(min=1))
    optim.shard_gradients_like_parameters([n.param for n in ctx.named])
    grad_norm = optim.clip_grad_norm(runtime, [n.param for n in ctx.named], ctx.config.train.max_grad_norm)
    rt.sync()
    loss_value, norm_value, token_count = loss.item(), grad_norm.item(), int(tokens.item())
    lr = ctx.schedule(state.step)
    finite = apply_update(state.optimizer, lr, loss_value, norm_value, state.step + 1, ctx.config.train.nonfinite)
    rt.sync()
    metrics = {"loss": loss_value, "tokens": token_count, "grad_norm": norm_value, "lr": float(lr),
               "skipped": not finite}
    return dataclasses.replace(state, step=state.step + 1), metrics


def count_label_tokens(state: TrainState, batch: Batch) -> int:
    """num_items_in_batch: label tokens of the global batch (SPMD: this process holds it all on one host)."""
    runtime = state.ctx.runtime
    if runtime.spmd and runtime.process_count > 1:
        _, labels, _ = _to_device(state.ctx, batch)
        return int((labels != IGNORE_INDEX).sum().item())
    return int(rt.host_sum(runtime, batch.num_label_tokens))


@torch.no_grad()
def eval_step(state: TrainState, batch: Batch, num_items_in_batch: int) -> dict:
    """{"loss_sum": Σ token losses over every device}; the eval layer divides by Σ num_items_in_batch once. A
    user's loss adds {"count": Σ its counts}, which the eval layer divides by instead."""
    state.model.eval()
    input_ids, labels, positions = _to_device(state.ctx, batch)
    loss, count = _loss_sum(state.ctx, state.model, input_ids, labels, positions)
    totals = [rt.device_sum(state.ctx.runtime, t).item() for t in (loss, count) if t is not None]
    return dict(zip(("loss_sum", "count"), totals))


@torch.no_grad()
def predict_step(state: TrainState, batch: Batch, return_logits: bool = False, preprocess_logits=None) -> dict:
    """Predictions of the global batch, full length, in order, on every process (`preprocess_logits`: the
    contract's, on this process's rows as xla tensors)."""
    ctx = state.ctx
    state.model.eval()
    input_ids, labels, positions = _to_device(ctx, batch)
    with _autocast(ctx):
        logits = logits_of(ctx.objective.outputs(state.model, input_ids, positions)).float()
    outputs = {"predictions": logits.argmax(-1)}
    if return_logits:
        outputs["logits"] = logits
    if preprocess_logits is not None:
        outputs["logits"] = preprocess_logits(logits, labels)
    if labels is not None:
        outputs["labels"] = labels
    return {k: rt.gather_rows(ctx.runtime, v) for k, v in outputs.items()}


def placement(state: TrainState) -> Placement:
    runtime = state.ctx.runtime
    dp_rank, dp_size = runtime.data_parallel
    return Placement(rank=runtime.rank, world_size=runtime.world_size, dp_rank=dp_rank, dp_size=dp_size,
                     process_count=runtime.process_count)


def barrier(state: TrainState, timeout_s: float | None = None) -> None:
    """xm.rendezvous (FSDP v1, unbounded) or the SPMD hosts' gloo group (runtime.barrier, bounded by
    train.collective_timeout_s from its creation): `timeout_s` has nothing to lengthen."""
    rt.barrier(state.ctx.runtime)


def any_rank(state: TrainState, flag: bool) -> bool:
    """True on every process when `flag` is true on any (free with one SPMD process per host)."""
    return rt.host_sum(state.ctx.runtime, int(flag)) > 0


def model_info(state: TrainState) -> ModelInfo:
    return state.ctx.info


def finalize(state: TrainState | None = None) -> None:
    """Wait for the device and say how much compiling the run took (a graph per new shape, then none)."""
    xm.wait_device_ops()
    if state is not None and state.ctx.runtime.rank == 0:
        graphs, seconds = rt.compilations()
        print(f"xla: {graphs} graphs compiled in {seconds:.1f} s", flush=True)
