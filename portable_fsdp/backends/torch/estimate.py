"""Memory of one training step per rank, measured without a device: the torch lowering's own start-up (mesh,
`parallelize`, AdamW) run on fake tensors over a fake process group, then one step under torch's FSDPMemTracker.

`estimate_rank` builds what `step.init` builds — the transformers model (inside FakeTensorMode: no weight is
ever allocated), the plan's DeviceMesh (`mesh.build_meshes`), float8, tensor / expert / context / sequence
parallelism, activation checkpointing and `fully_shard` (`parallelize.parallelize`), the chunked loss
(`hf_torch.chunked_loss.install`), the optimizer (`hf_torch.optimizer.build_optimizer`) — and trains one step of a fake micro-batch of the config's per-rank size
through the step's own sharding and loss (`step.sharded_batch`, `step.rank_loss_sum`). The tracker attributes every
storage alive at each operation to parameters, gradients, optimizer state, activations, FSDP's gathered
buffers or temporaries; the step's peak is the largest total, with what made it up at that moment.

What it does not model: the CUDA caching allocator's rounding and fragmentation, the CUDA context and NCCL's
buffers, flash attention kernels (CPU's SDPA kernel is traced; its saved tensors are the same shape),
torch.compile's fusions (compiled layers are traced eagerly), Liger's fused loss kernel (the chunked loss is
traced), and the gradient-norm computation (a few scalars per parameter).

The fake process group must never meet a real one: this runs only in the estimator's own process
(portable_fsdp.estimate starts it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from portable_fsdp.backends.hf_torch import adapters, chunked_loss, experts, model as model_lib
from portable_fsdp.backends.hf_torch.loss import RouterLoss
from portable_fsdp.backends.hf_torch.optimizer import build_optimizer
from portable_fsdp.backends.torch import distributed, expert_parallel, local_experts, step as step_lib
from portable_fsdp.backends.torch.context_parallel import CPGroup
from portable_fsdp.backends.torch.mesh import build_meshes
from portable_fsdp.backends.torch.parallelize import apply_fsdp, parallelize
from portable_fsdp.backends.torch.sequence_parallel import SPGroup
from portable_fsdp.backends.torch.tensor_parallel import all_reduce_replicated_gradients
from portable_fsdp.config.schema import from_dict
from portable_fsdp.errors import UserError
from portable_fsdp.data.batch import Batch
from portable_fsdp.training.loss_chunks import Chunking
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.training.schedule import for_config as schedule_for
from portable_fsdp.config.validate import resolve_plan

# The trackers' categories (FSDPMemTracker's for an FSDP2 module, MemTracker's for the plain module one rank
# trains alone), grouped as the estimate reports them.
CATEGORIES = {
    "parameters": ("Sharded Param", "Parameter", "Buffer"),
    "gradients": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs", "Other"),
    "gathered": ("Unsharded Param", "All Gather"),
    "unsharded_gradients": ("Unsharded Grad", "Reduce Scatter"),
    "temporaries": ("Temp",),
}
GROUP_OF = {kind: name for name, kinds in CATEGORIES.items() for kind in kinds}
# Under plan.cpu_offload these live in host memory: the device's peak leaves them out.
OFFLOADED = ("parameters", "gradients", "optimizer")


class _Peaks:
    """Mixed into a tracker: the largest total of the categories on the device (all of them, or all but the
    offloaded ones) with its breakdown, and the largest value each category reached."""

    def _start_peaks(self, offloaded: bool) -> None:
        self._on_host = set(OFFLOADED) if offloaded else set()
        self.device_peak, self.at_peak, self.largest = 0, dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0)

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        now = self.current()
        on_device = sum(value for name, value in now.items() if name not in self._on_host)
        if on_device > self.device_peak:
            self.device_peak, self.at_peak = on_device, now
        for name, value in now.items():
            self.largest[name] = max(self.largest[name], value)

    def current(self) -> dict:
        """The categories now, grouped."""
        now = dict.fromkeys(CATEGORIES, 0)
        for snapshot in self._curr_mem_snap.values():
            for kind, value in snapshot.items():
                group = GROUP_OF.get(getattr(kind, "value", kind))
                if group:
                    now[group] += value
        return now


class _FSDPTracker(_Peaks, FSDPMemTracker):
    def __init__(self, model, optimizer, offloaded: bool):
        super().__init__(model, optimizer)
        self._start_peaks(offloaded)


class _PlainTracker(_Peaks, MemTracker):
    def __init__(self, model, optimizer, offloaded: bool):
        super().__init__()
        self.track_external(model, optimizer)
        self._start_peaks(offloaded)


def tracker_for(model, optimizer, offloaded: bool):
    cls = _FSDPTracker if isinstance(model, FSDPModule) else _PlainTracker
    return cls(model, optimizer, offloaded)


METHOD = "torch FSDP2 lowering traced over a fake process group (FakeTensorMode, FSDPMemTracker), one step"


def estimate_memory(request: dict) -> dict:
    """The backend contract's estimate (portable_fsdp/backend.py)."""
    return {**estimate_ranks(request["config"], request["world"], request["ranks"], request["backend"],
                             request["host_is_device"]), "method": METHOD}


def estimate_ranks(config_dict: dict, world_size: int, ranks: list, target: str, host_is_device: bool = False) -> dict:
    """{"ranks": [estimate_rank(...) of each of `ranks`], "model": the model's ModelInfo as a dict}. `target`: the
    device type the run trains on (cuda or cpu), which picks the optimizer's kernel. `host_is_device`: the
    ranks train on the host's memory (cpu), so plan.cpu_offload moves nothing off it."""
    config = from_dict(config_dict)
    info = model_lib.describe_model(config)
    per_rank = [estimate_rank(config, world_size, rank, target, info, host_is_device) for rank in ranks]
    return {"ranks": per_rank, "model": dataclasses.asdict(info)}


def estimate_rank(config, world_size: int, rank: int, target: str, info, host_is_device: bool = False) -> dict:
    began = time.perf_counter()
    plan = resolve_plan(config, world_size)
    # FSDP's collectives through gloo's path: the shared-memory one (cpu_collectives=auto) maps real buffers.
    # Compiled layers are traced eagerly (dynamo does not run on fake tensors here; its fusions lower activations).
    plan = dataclasses.replace(plan, cpu_collectives="gloo", compile=False)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _quiet_warnings():
            return {"rank": rank, **_traced_step(config, plan, rank, world_size, target, info, host_is_device),
                    "seconds": time.perf_counter() - began}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _traced_step(config, plan, rank: int, world_size: int, target: str, info, host_is_device: bool) -> dict:
    device = torch.device("cpu")
    meshes = build_meshes(plan.mesh, "cpu")  # real tensors: a DeviceMesh reads its rank list
    cp = sp = None
    if meshes.cp is not None:
        cp = CPGroup(group=meshes.cp.get_group(), mesh=meshes.cp, cp_rank=meshes.cp_rank, cp_size=plan.mesh.cp_size,
                     rotate_method=plan.cp_rotate_method, impl=plan.resolved_cp_impl("cpu"),
                     load_balance=plan.cp_load_balance)
    if meshes.sp is not None:
        sp = SPGroup(group=meshes.sp.get_group(), sp_rank=meshes.sp_rank, sp_size=plan.mesh.sp_size)
    micro_rows = config.train.batch_size // (plan.mesh.data_parallel_size * config.train.grad_accum_steps)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model_lib.create_model(config, rank, rank0_only=False)
        adapters.add(model, config.model.peft)
        model_lib.freeze_parameters(model, config.train.freeze)
        if config.train.gradient_checkpointing:
            model_lib.enable_gradient_checkpointing(model)
        layer_classes = plan.wrap_classes(info)
        experts.set_implementation(model, experts.choose(target))
        logits_sharded = parallelize(model, plan, meshes, cp, sp, layer_classes, "cpu", tensor_parallel_plan(plan, info),
                                     decide_for=target)
        if target == "cuda" and plan.cpu_offload and not isinstance(model, FSDPModule):
            # one GPU with CPU offload trains under FSDP2, which the lowering skips for one CPU rank
            apply_fsdp(model, plan, meshes, layer_classes, "cpu", decide_for=target)
        if not logits_sharded:  # as step.init: the loss a chunk of tokens at a time
            chunked_loss.install(model, Chunking(config.train.loss_chunk_tokens), "cpu")
        model.to_empty(device=device)
        if config.train.optimizer == "adafactor":  # it calls .item() each step, which fake tensors cannot answer
            raise UserError("train.optimizer", "= adafactor: torch's Adafactor reads values on the host and cannot be "
                            "estimated; estimate with train.optimizer=adamw, whose two moments outweigh its state")
        optimizer = build_optimizer(((p, p.ndim) for p in model.parameters()), config.train,
                                "cpu" if plan.cpu_offload else target)
        _create_optimizer_state(model, optimizer)
        runtime = distributed.Runtime(target, rank, world_size, rank, device)
        ctx = step_lib.Context(runtime, plan, config, meshes, cp, sp, logits_sharded, info,
                               schedule_for(config.train), 0.0)
        batches = _micro_batches(config, micro_rows)
        offloaded = plan.cpu_offload and not host_is_device
        tracker = tracker_for(model, optimizer, offloaded)
        with tracker, _traceable_experts():
            _one_step(ctx, model, optimizer, batches, config.train.grad_accum_steps, tracker)
    after = tracker.current()
    # What a rank holds between steps (parameters, AdamW's moments) and its gradient shards once backward ends.
    held = {"parameters": after["parameters"], "gradients": tracker.largest["gradients"],
            "optimizer": after["optimizer"]}
    return {"peak": tracker.device_peak, "at_peak": tracker.at_peak, "held": held, "largest": tracker.largest,
            "micro_batch_rows": micro_rows, "micro_batches_traced": len(batches),
            "tokens_per_rank": micro_rows * config.data.seq_len // plan.mesh.sequence_size,
            "cpu_offload": offloaded}


@contextlib.contextmanager
def _traceable_experts():
    """Around the traced step, what a mixture of experts computes from the router's choices, which fake tensors
    do not hold:
    - under expert parallelism, each rank's (token, expert) pairs are taken as spread evenly over the experts
      (`balanced_routes`): the same rows are exchanged and computed as with any routing, only their split
      between the experts differs;
    - `grouped_mm` experts (hf_torch.experts.choose) in another dtype than bfloat16 go through transformers' own
      fallback op, whose fake-tensor kernel gives the same output; torch's fake kernel of `_grouped_mm` refuses
      them (it checks the rule of CUDA's fast kernel: bfloat16 only). bfloat16 ones trace torch's own op. An ep
      rank's local experts likewise (local_experts.local_kernel): one product per expert instead, on the same rows
      (the outputs and what backward keeps are the same tensors' sizes)."""
    from transformers.integrations import moe

    saved = [(expert_parallel, "route_counts", expert_parallel.route_counts),
             (local_experts, "local_kernel", local_experts.local_kernel)]
    expert_parallel.route_counts = balanced_routes
    chosen = local_experts.local_kernel
    local_experts.local_kernel = lambda device_type, dtype, *shape: (chosen(device_type, dtype, *shape)
                                                                      if dtype == torch.bfloat16 else local_experts.SLICES)
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is not None:  # (another transformers: nothing to steer)
        saved.append((moe, "_can_use_grouped_mm", original))
        moe._can_use_grouped_mm = lambda input, weight, offs: (weight.dtype == torch.bfloat16
                                                               and original(input, weight, offs))
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def balanced_routes(expert_ids: torch.Tensor, num_experts: int, group) -> tuple:
    """expert_parallel.route_counts as if every rank sent each expert an equal share of its pairs (one more to
    the first experts when they do not divide)."""
    pairs, ranks = expert_ids.numel(), group.size()
    per_expert = [pairs // num_experts + (expert < pairs % num_experts) for expert in range(num_experts)]
    local = num_experts // ranks
    mine = per_expert[dist.get_rank(group) * local:][:local]
    return per_expert, [list(mine) for _ in range(ranks)]


def _create_optimizer_state(model, optimizer) -> None:
    """AdamW's moments exist from the first step on: create them before the traced step (zero gradients, one
    update), so the step's peak includes them as every later step's does."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _micro_batches(config, rows: int) -> list:
    """Micro-batches shaped as the loader makes them for this rank. With gradient accumulation, two: FSDP keeps
    unsharded gradients from the first to the last, so the second holds what every later one holds."""
    seq = config.data.seq_len
    ids = np.zeros((rows, seq), dtype=np.int64)
    positions = segments = None
    if config.data.document_masking:
        positions = np.broadcast_to(np.arange(seq), (rows, seq)).copy()
        segments = np.zeros((rows, seq), dtype=np.int64)
    batch = Batch(input_ids=ids, labels=ids.copy(), position_ids=positions, segment_ids=segments)
    return [batch] * min(config.train.grad_accum_steps, 2)


def _one_step(ctx, model, optimizer, batches: list, accumulation: int, tracker) -> None:
    """The step's forward and backward (step.compute_gradients without its host-side token counting: fake
    tensors hold no values), then the update."""
    tokens = float(sum(b.labels.size for b in batches) * ctx.plan.mesh.data_parallel_size)
    router = RouterLoss(tokens / accumulation, lambda t: _sum_over_ranks(t, ctx.plan.mesh.tp_size))
    for index, batch in enumerate(batches):
        if index:
            tracker.reset_mod_stats()  # per-module statistics only (they refuse a second forward of the root)
        if isinstance(model, FSDPModule):  # reduce-scatter after the last only
            model.set_requires_gradient_sync(index == len(batches) - 1)
        with step_lib.sharded_batch(ctx, batch) as (input_ids, labels, positions), step_lib.loss_context(ctx):
            loss, _ = step_lib.rank_loss_sum(ctx, model, input_ids, labels, positions, router)
            (loss / tokens).backward()
    if ctx.meshes.tp is not None:
        all_reduce_replicated_gradients(model, ctx.meshes.tp.get_group(), ctx.runtime.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sum_over_ranks(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor.div_(tp_size)
