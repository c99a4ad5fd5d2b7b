"""The torch lowering's side of the backend contract (the `Backend` Protocol in portable_fsdp/backend.py):
start-up, the training and evaluation steps, and what the loop asks of a running state.

Losses are Σ token losses / Σ label tokens of the whole (accumulated, all-rank) batch, the tokens counted
before context or sequence parallelism shards a batch, by one rank of each group that shares a batch (its
cp|sp × tp ranks). FSDP sums gradients over its mesh (parallelize.sum_gradients; HSDP's replicas included), so
each rank's backward scales its token-loss sum by 1 / global_tokens. A tp group computes one loss, replicated:
its sum is counted once, never tp_size times. A user's loss counts its own tokens (parts.loss): its sums are
backpropagated unscaled, and the gradients divided once by Σ count (summed as the token-loss sums are) before
clipping.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from portable_fsdp.backends.hf_torch import adapters, chunked_loss, custom_model, experts, model as model_lib
from portable_fsdp.backends.hf_torch.custom_model import logits_of
from portable_fsdp.backends.hf_torch.loss import Objective, RouterLoss, accumulate_gradients, divide_gradients
from portable_fsdp.backends.hf_torch.optimizer import apply_update, build_optimizer, learning_rates
from portable_fsdp.backends.torch import checkpoint, distributed
from portable_fsdp.backends.torch import float8
from portable_fsdp.backends.torch import host_allocator, resources
from portable_fsdp.backends.torch import save_process
from portable_fsdp.backends.torch import sequence_parallel
from portable_fsdp.backends.torch.context_parallel import CPGroup, sequence_shard
from portable_fsdp.backends.torch.context_parallel.collectives import gather_sequence_no_grad
from portable_fsdp.backends.torch.mesh import Meshes, build_meshes
from portable_fsdp.backends.torch.model import broadcast_from_rank0, fill, materialize_shards
from portable_fsdp.backends.torch.parallelize import DTYPES, parallelize, shards
from portable_fsdp.backends.torch.sequence_parallel import SPGroup
from portable_fsdp.backends.torch.tensor_parallel import all_reduce_replicated_gradients, sync_rng
from portable_fsdp.data.batch import Batch
from portable_fsdp.backend import ModelInfo, Placement
from portable_fsdp.training.loss_chunks import Chunking
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.plan import ShardingPlan
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts
from portable_fsdp.training.sequence_split import gathered_order


@dataclasses.dataclass(frozen=True)
class Context:
    """What a step needs besides the mutable model and optimizer."""

    runtime: distributed.Runtime
    plan: ShardingPlan
    config: object
    meshes: Meshes
    cp: CPGroup | None
    sp: SPGroup | None
    logits_sharded: bool  # over the vocabulary (tensor parallelism): the loss runs under loss_parallel
    info: ModelInfo
    schedule: object
    baseline_mb: float  # memory in use before the model existed (libraries, process group; CUDA context, NCCL)
    objective: Objective = Objective()  # the model's call and the loss (the user's, when passed in)

    @property
    def counts_tokens(self) -> bool:
        """One rank per cp|sp × tp group counts a batch's label tokens (its ranks share the batch)."""
        return self.meshes.leads_batch_group

    @property
    def counts_loss(self) -> bool:
        """One rank per tp group adds its token-loss sum (a tp group computes one loss; cp|sp ranks hold
        different tokens, each adds its own)."""
        return self.meshes.coordinates["tp"] == 0


@dataclasses.dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int
    ctx: Context


def init(config, plan: ShardingPlan, backend: str, parts: Parts = NO_PARTS) -> TrainState:
    """`parts`: the user's model, loss, optimizer factory and schedule, each in place of the config's."""
    if parts.model is not None:  # before any process group: a wrong part is one line
        custom_model.check_run(parts.model, config, plan)
    runtime = distributed.initialize(backend, config.train.collective_timeout_s)
    if runtime.device.type == "cpu" or plan.cpu_offload:  # a step that computes on host memory
        host_allocator.keep_freed_blocks()
    if plan.float8:  # before the model is built: torchao missing, or a GPU without float8, is one line
        float8.check_supported(runtime.device, _tokens_per_rank(config, plan))
    info = model_lib.describe_model(config, parts)  # imports the model's code: part of the libraries' memory
    baseline_mb = resources.in_use_mb(runtime.device)
    layer_classes = plan.wrap_classes(info)
    meshes = build_meshes(plan.mesh, runtime.device.type)
    cp = sp = None
    if meshes.cp is not None:
        cp = CPGroup(group=meshes.cp.get_group(), mesh=meshes.cp, cp_rank=meshes.cp_rank, cp_size=plan.mesh.cp_size,
                     rotate_method=plan.cp_rotate_method, impl=plan.resolved_cp_impl(runtime.device.type),
                     load_balance=plan.cp_load_balance)
    if meshes.sp is not None:
        sp = SPGroup(group=meshes.sp.get_group(), sp_rank=meshes.sp_rank, sp_size=plan.mesh.sp_size)
    rank0_only = plan.cpu_ram_efficient_loading and parts.model is None
    model, on_meta = _build_model(config, plan, meshes, runtime, parts)
    adapters.add(model, config.model.peft)  # before parallelize: its layers are sharded with the base's
    full_weights = model.state_dict() if rank0_only and runtime.rank == 0 else None
    model_lib.freeze_parameters(model, config.train.freeze)
    if config.train.gradient_checkpointing:
        model_lib.enable_gradient_checkpointing(model)
    experts.set_implementation(model, experts.choose(runtime.device.type))
    logits_sharded = parallelize(model, plan, meshes, cp, sp, layer_classes, runtime.device.type,
                                 tensor_parallel_plan(plan, info))
    objective = Objective(custom_model.Forward.of(parts.model) if parts.model is not None else None, parts.loss)
    if not logits_sharded and objective == Objective():  # a vocabulary-split lm_head keeps its loss_parallel loss
        chunked_loss.install(model, Chunking(config.train.loss_chunk_tokens), runtime.device.type)
    parameters_on = state_device(plan, runtime.device)
    if rank0_only and isinstance(model, FSDPModule):  # one rank alone built the whole model already
        broadcast_from_rank0(model, full_weights, parameters_on, runtime.device)
    if on_meta:
        materialize_shards(model, on_meta, parameters_on, runtime.device)
    if adapters.wanted(config.model.peft):  # the same starting adapters however the base was built
        adapters.initialize(model, config.seed, fill)
    sync_rng(meshes.tp, runtime.device)  # dropout on the replicated activations of a tp group must agree
    optimizer = build_optimizer(((p, p.ndim) for p in model.parameters()), config.train, parameters_on.type,
                                parts.optimizer)
    return TrainState(model, optimizer, 0, Context(runtime, plan, config, meshes, cp, sp, logits_sharded, info,
                                                   learning_rates(parts, config.train), baseline_mb, objective))


def _build_model(config, plan: ShardingPlan, meshes: Meshes, runtime, parts: Parts) -> tuple:
    """(the model, its hf_torch.deferred_init.OnMeta when each rank fills its own shards once it is sharded, else None).
    Sharded, every rank builds the config's model on the meta device; a user's module is taken as it is given,
    built or on the meta device (then initialised by its own init, seeded by train.seed)."""
    sharded = shards(plan, meshes.world.size(), runtime.device.type)
    if parts.model is not None:
        on_meta = custom_model.on_meta(parts.model, config.seed)
        if on_meta is not None and not sharded:  # one rank trains the plain module: fill it whole now
            materialize_shards(parts.model, on_meta, torch.device("cpu"), torch.device("cpu"))
            on_meta = None
        return parts.model, on_meta
    rank0_only = plan.cpu_ram_efficient_loading
    on_meta = model_lib.create_on_meta(config) if sharded and not rank0_only else None
    return (on_meta.model if on_meta else model_lib.create_model(config, runtime.rank, rank0_only)), on_meta


def _tokens_per_rank(config, plan: ShardingPlan) -> int:
    """Tokens of one micro-batch on one rank: its rows times its share of each sequence."""
    mesh = plan.mesh
    rows = config.train.batch_size // (mesh.data_parallel_size * config.train.grad_accum_steps)
    return rows * config.data.seq_len // mesh.sequence_size


def state_device(plan: ShardingPlan, device: torch.device) -> torch.device:
    """Where parameters, gradients and optimizer state live: host memory under plan.cpu_offload, else the
    device the rank computes on (buffers, activations and gathered parameters are always there)."""
    return torch.device("cpu") if plan.cpu_offload else device


def _all_reduce_sum(values: list, device: torch.device) -> list:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def train_step(state: TrainState, micro_batches: list) -> tuple:
    with resources.snapshot_on_out_of_memory():  # the first step also allocates the optimizer's moments
        return _train_step(state, micro_batches)


def _train_step(state: TrainState, micro_batches: list) -> tuple:
    ctx = state.ctx
    loss, global_tokens = compute_gradients(state, micro_batches)
    grad_norm = clip_grad_norm(state.model, ctx.config.train.max_grad_norm, ctx.runtime.device)
    lr = ctx.schedule(state.step)
    checkpoint.staged()  # a background save's copy of the weights and moments, made during the forward and backward
    finite = apply_update(state.optimizer, lr, loss, grad_norm, state.step + 1, ctx.config.train.nonfinite)
    if ctx.runtime.device.type == "cuda":  # the step's time includes its update, still queued on the GPU
        torch.cuda.synchronize(ctx.runtime.device)
    metrics = {"loss": loss, "tokens": int(global_tokens), "grad_norm": grad_norm, "lr": float(lr),
               "skipped": not finite}
    return dataclasses.replace(state, step=state.step + 1), metrics


def compute_gradients(state: TrainState, micro_batches: list) -> tuple:
    """Forward and backward of this rank's micro-batches: every parameter's (sharded) gradient is then the
    gradient of the global batch's mean token loss (a user's loss: Σ sum / Σ count). Returns (that loss, the
    global batch's label tokens)."""
    ctx, model = state.ctx, state.model
    device = ctx.runtime.device
    model.train()
    counted = sum(b.num_label_tokens for b in micro_batches) if ctx.counts_tokens else 0
    counts_itself = ctx.objective.loss is not None  # its count is known after the forward: scale afterwards
    global_tokens = 0.0 if counts_itself else _all_reduce_sum([counted], device)[0]
    scale = 1.0 if counts_itself else 1.0 / max(global_tokens, 1.0)  # FSDP sums gradients (parallelize.sum_gradients)
    # a MoE router's load-balancing loss (output_router_logits) over the whole batch, weighed as the model does
    router = None if counts_itself else RouterLoss(global_tokens / len(micro_batches),
                                                   lambda t: _sum_over_tokens(t, ctx.plan.mesh.tp_size))

    @contextlib.contextmanager
    def forward(index: int, batch: Batch):
        if isinstance(model, FSDPModule):  # reduce-scatter after the last only
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        # The backward runs inside: checkpointed layers re-run CP/SP attention on these shards.
        with sharded_batch(ctx, batch) as (input_ids, labels, positions), loss_context(ctx):
            yield rank_loss_sum(ctx, model, input_ids, labels, positions, router)

    loss_sum, count = accumulate_gradients(micro_batches, forward, scale, rank=ctx.runtime.rank,
                                           step=state.step + 1, sum_dtype=torch.float64)
    if ctx.meshes.tp is not None:
        all_reduce_replicated_gradients(model, ctx.meshes.tp.get_group(), device)
    if counts_itself:  # one all-reduce: the label tokens, the user's sums and counts (a tp group's once)
        global_tokens, total_loss, total_count = _all_reduce_sum(
            [counted, *([loss_sum.item(), count.item()] if ctx.counts_loss else [0.0, 0.0])], device)
        divide_gradients(model.parameters(), total_count or 1.0)
        return total_loss / (total_count or 1.0), global_tokens
    (total_loss,) = _all_reduce_sum([loss_sum.item() if ctx.counts_loss else 0.0], device)
    return total_loss / max(global_tokens, 1.0), global_tokens


@contextlib.contextmanager
def sharded_batch(ctx: Context, batch: Batch):
    """This rank's (input_ids, labels, position_ids) of `batch`: a sequence slice under cp or sp, else all of it."""
    device = ctx.runtime.device
    if ctx.sp is not None:
        with sequence_parallel.sequence_shard(ctx.sp, batch, device) as tensors:
            yield tensors
    else:
        with sequence_shard(ctx.cp, batch, device) as tensors:
            yield tensors


def loss_context(ctx: Context):
    """torch's loss_parallel around a loss on vocabulary-sharded logits, its forward and backward: the
    cross-entropy then reduces over the tp group, and no rank gathers a full-vocabulary row."""
    if not ctx.logits_sharded:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _sum_over_tokens(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """`tensor` summed over every rank, in place, each token counted once (a tp group's ranks hold copies)."""
    dist.all_reduce(tensor)
    return tensor.div_(tp_size)


def rank_loss_sum(ctx: Context, model, input_ids, labels, positions, router: RouterLoss | None = None) -> tuple:
    """(Σ token losses of this rank's tokens, their count or None: the built-in loss), plain tensors (under
    loss_parallel, the local values of the replicated loss). The forward only: a backward runs outside
    `_mixed_precision`."""
    with _mixed_precision(ctx, model):
        loss, count = ctx.objective(model, input_ids, labels, positions, router)
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (loss, count)]
    return tuple(local)


def _mixed_precision(ctx: Context, model) -> contextlib.AbstractContextManager:
    """Around a forward: plan.param_dtype for a plain module (a world of one rank; parallelize.shards) through
    autocast — FSDP2's MixedPrecisionPolicy casts a wrapped model's parameters itself."""
    dtype = ctx.plan.mixed_precision.param_dtype
    if dtype == "float32" or isinstance(model, FSDPModule):
        return contextlib.nullcontext()
    return torch.autocast(ctx.runtime.device.type, dtype=DTYPES[dtype])


def clip_grad_norm(model: torch.nn.Module, max_norm: float, device: torch.device) -> float:
    """Global L2 norm of the gradients, then in-place scaling (works on CPU-offloaded DTensor gradients, where
    torch's clip_grad_norm_ does not, and on parameters living on different meshes — norm weights sharded over
    the data-parallel mesh only, tensor-parallel weights over (dp, tp) — where it fails too).

    Every rank adds the squares of its local pieces, each weighted by the share of the world that holds that
    very piece: a DTensor's local shard is held by world / (product of its sharded mesh dimensions) ranks (its
    replicas: replicated mesh dimensions, and every rank outside its mesh, e.g. the tp ranks of a norm weight);
    a plain tensor by every rank. One all-reduce of the weighted sums then counts every element once. The squares
    are summed in float64 where the gradients are (host memory under plan.cpu_offload), and cross to `device` once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    world = dist.get_world_size()
    where: dict = {}  # device -> Σ weighted squares of the pieces there
    for grad, piece in zip(grads, local):
        holders = world // _shard_count(grad) if isinstance(grad, DTensor) else world
        square = torch.linalg.vector_norm(piece.detach(), dtype=torch.float64).square() / holders
        where[piece.device] = where.get(piece.device, 0.0) + square
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for total in where.values():
        squares += total.to(device)
    dist.all_reduce(squares)
    norm = math.sqrt(max(squares.item(), 0.0))
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in local:
                g.mul_(coef)
    return norm


def _shard_count(tensor: DTensor) -> int:
    """Into how many distinct pieces `tensor` is split (the sizes of the mesh dimensions it is sharded over)."""
    sizes = tensor.device_mesh.mesh.shape
    return math.prod(size for size, p in zip(sizes, tensor.placements) if p.is_shard())


def count_label_tokens(state: TrainState, batch: Batch) -> int:
    """num_items_in_batch: label tokens of the global batch, counted before any cp sharding (a collective)."""
    counted = batch.num_label_tokens if state.ctx.counts_tokens else 0
    return int(_all_reduce_sum([counted], state.ctx.runtime.device)[0])


@torch.no_grad()
def eval_step(state: TrainState, batch: Batch, num_items_in_batch: int) -> dict:
    """{"loss_sum": Σ token losses over every rank}; the eval layer divides by Σ num_items_in_batch once. A
    user's loss adds {"count": Σ its counts over every rank}, which the eval layer divides by instead."""
    ctx = state.ctx
    state.model.eval()
    with sharded_batch(ctx, batch) as (input_ids, labels, positions), loss_context(ctx):
        loss, count = rank_loss_sum(ctx, state.model, input_ids, labels, positions)
        mine = [loss.item(), *([] if count is None else [count.item()])]
    _reshard(state.model)
    totals = _all_reduce_sum([v if ctx.counts_loss else 0.0 for v in mine], ctx.runtime.device)
    return dict(zip(("loss_sum", "count"), totals))


def _reshard(model: torch.nn.Module) -> None:
    """A forward without backward leaves gathered the units that do not reshard after forward (the root,
    or every unit with reshard_after_forward=false; training's backward reshards them): free that memory
    and register the sharded parameters again, which checkpoint saves and loads expect."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def predict_step(state: TrainState, batch: Batch, return_logits: bool = False, preprocess_logits=None) -> dict:
    """Predictions of the global batch, full length, in the original token order, on every rank.

    Logits stay sharded along the sequence during the forward; only here are they gathered over the cp|sp
    group (and the load-balanced split undone), then over the data-parallel ranks (and over the vocabulary
    when tensor parallelism leaves them split there). `return_logits` gathers the full
    [global batch, seq_len, vocab] logits on every rank: that much memory per rank; `preprocess_logits` (the
    contract's) shrinks each rank's full-length rows before that gather. Batches without labels take the same
    path."""
    ctx = state.ctx
    state.model.eval()
    with sharded_batch(ctx, batch) as (input_ids, _, positions), _mixed_precision(ctx, state.model):
        logits = logits_of(ctx.objective.outputs(state.model, input_ids, positions))
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits = logits.float()
    _reshard(state.model)
    outputs = {"predictions": logits.argmax(-1)}
    if return_logits or preprocess_logits is not None:
        outputs["logits"] = logits
    if ctx.cp is not None:
        outputs = {k: _unshard_sequence(v, ctx.cp.group, ctx.cp.cp_size, ctx.cp.load_balance)
                   for k, v in outputs.items()}
    if ctx.sp is not None:
        outputs = {k: _unshard_sequence(v, ctx.sp.group, ctx.sp.sp_size, False) for k, v in outputs.items()}
    labels = None if batch.labels is None else torch.from_numpy(batch.labels).to(ctx.runtime.device)
    if preprocess_logits is not None:
        outputs["logits"] = preprocess_logits(outputs["logits"], labels)
    if labels is not None:
        outputs["labels"] = labels
    return {k: _gather_data_parallel(v, ctx).cpu().numpy() for k, v in outputs.items()}


def _unshard_sequence(local: torch.Tensor, group, size: int, load_balance: bool) -> torch.Tensor:
    gathered = gather_sequence_no_grad(local, group, dim=1)
    order = torch.from_numpy(gathered_order(gathered.shape[1], size, load_balance)).to(local.device)
    return torch.empty_like(gathered).index_copy_(1, order, gathered)


def _gather_data_parallel(full_length: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Rows of every data-parallel rank, in global-batch order: the ranks of a cp|sp × tp group are neighbours
    and hold identical copies, so one in every group's size is taken."""
    parts = [torch.empty_like(full_length) for _ in range(ctx.runtime.world_size)]
    dist.all_gather(parts, full_length.contiguous())
    return torch.cat(parts[::ctx.meshes.batch_group_size])


def placement(state: TrainState) -> Placement:
    return Placement(rank=state.ctx.runtime.rank, world_size=state.ctx.runtime.world_size,
                     dp_rank=state.ctx.meshes.dp_rank, dp_size=state.ctx.meshes.dp_size)


def barrier(state: TrainState, timeout_s: float | None = None) -> None:
    """Every rank arrives; within `timeout_s` when given (a gloo group of its own), else the process group's."""
    dist.barrier(group=distributed.slow_group(timeout_s) if timeout_s is not None else None)


def any_rank(state: TrainState, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank."""
    tensor = torch.tensor([int(flag)], device=state.ctx.runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def model_info(state: TrainState) -> ModelInfo:
    return state.ctx.info


def finalize(state: TrainState | None = None) -> None:
    save_process.close()
    distributed.shutdown()
