"""Tensor parallelism for the torch lowering: the plan's tensor-parallel plan (transformers' base_model_tp_plan
notation, module patterns relative to the base model, `layers.*.self_attn.q_proj`) applied by hand with torch's
`parallelize_module` over the tp mesh, before FSDP shards the result over the data-parallel mesh.

Weights are not loaded through transformers' `DistributedConfig`: combined with data parallelism it places
some shards on the wrong ranks without an error. Here every rank builds the same full model and keeps its own
slice of each weight (`src_data_rank=None`: nothing is sent; with cpu_ram_efficient_loading the other ranks'
meta-device slices are filled from rank 0 once FSDP has sharded them).

- colwise: a Linear's output features are split (ColwiseParallel): q/k/v give each rank whole heads, gate/up
  a slice of the MLP; outputs stay local tensors, so the model's attention runs unchanged on its heads. The colwise
  layers of one module that read the same tensor (q/k/v the attention's input, gate/up the MLP's) share one
  replicated DTensor of it (`SharedInput`): their input gradients, each partial over the tp group, add up before
  one all-reduce makes the sum whole — Megatron's 4 all-reduces per layer (after o_proj and down_proj in forward,
  at the attention's and the MLP's input in backward), where a DTensor per layer costs 7 (q, k, v, gate and up
  each reduce their own).
- rowwise: a Linear's input features are split (RowwiseParallel), its outputs summed over the tp group.
- replicated_with_grad_allreduce: the weight stays whole on every tp rank, but each rank's gradient covers only
  its heads (per-head q/k norms): `all_reduce_replicated_gradients` sums them over the tp group after backward.
- The output projection (lm_head, when not tied to the input embedding) is split over the vocabulary with its
  logits left sharded: the loss runs under torch's `loss_parallel`, so no rank gathers a full-vocabulary row
  (fp32 logits of a 128k vocabulary are the largest activation of a step). A tied lm_head stays whole: the
  embedding it shares would have to be split over the vocabulary too.
- Every rank of a tp group draws the same random numbers (`sync_rng`, at start-up and after a resume): dropout on
  the activations the group holds replicated agrees across it; attention dropout, inside the split, then draws
  the same mask for each rank's share of the heads.
- Sequence-parallel norms are not applied: transformers' decoder layers add the residual on plain tensors
  between the norms and the projections, so the residual stream cannot stay sequence-sharded through a layer
  without rewriting its forward; norms and residuals run replicated on every tp rank.
- A mixture-of-experts layer's experts (packed_colwise, moe_tp_experts, and what the plan names inside them) stay
  whole on every tp rank, which then routes and computes the same tokens alike: experts are split by expert
  parallelism (plan.ep_size), attention by tensor parallelism.

Which modules a key names, and what stays whole, is portable_fsdp/placement.py's rule, the one every backend
follows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from portable_fsdp import placement
from portable_fsdp.errors import UserError

GRAD_ALL_REDUCE = "_portable_fsdp_tp_grad_all_reduce"  # set on modules whose weight gradients are partial per rank


def split_modules(base: nn.Module, tp_plan: dict, strict: bool) -> dict:
    """{module name under `base`: style} of the modules the plan splits or marks (portable_fsdp.placement: `*`
    a layer index, a MoE layer's experts left whole). `strict`: a key that names no module or parameter is an
    error (a plan the user wrote)."""
    modules = [name for name, _ in base.named_modules() if name]
    parameters = [name for name, _ in base.named_parameters()]
    unmatched = placement.unmatched_keys(tp_plan, modules + parameters)
    if unmatched and strict:
        raise UserError("plan.tp_plan", (
            f"{unmatched[0]!r} matches no module of the model (keys are relative to the base model, with * for a "
            f"layer index; names look like {', '.join(modules[-3:])})"))
    placement.check_parameter_keys(tp_plan, parameters)
    return placement.tp_modules(tp_plan, modules)


def apply_tensor_parallel(model: nn.Module, tp_mesh, tp_plan: dict, *, strict: bool = False) -> bool:
    """Split the modules `tp_plan` names over `tp_mesh` in place; returns whether the logits come out sharded over
    the vocabulary (the loss must then run under `loss_parallel`)."""
    base = getattr(model, "base_model", model)  # what the plan's keys are relative to (a user's module: itself)
    shared_inputs = {}  # parent module name -> its SharedInput
    for name, style in split_modules(base, tp_plan, strict).items():
        module = base.get_submodule(name)
        if style == "colwise":
            parent = name.rpartition(".")[0]
            if parent not in shared_inputs:
                shared_inputs[parent] = SharedInput(base.get_submodule(parent), tp_mesh)
            shared_inputs[parent].reader(module)
            parallelize_module(module, tp_mesh, ColwiseParallel(), src_data_rank=None)
        elif style == "rowwise":
            parallelize_module(module, tp_mesh, RowwiseParallel(), src_data_rank=None)
        else:  # replicated_with_grad_allreduce
            setattr(module, GRAD_ALL_REDUCE, True)
    return _shard_logits(model, tp_mesh)


class SharedInput:
    """One replicated DTensor per tensor that the colwise layers under `owner` read during one call of `owner`
    (its forward hooks clear them): ColwiseParallel takes a DTensor input as it is, so autograd sums the layers'
    partial input gradients as one DTensor, reduced over the tp group once when it turns back into the local
    tensor. Matched by identity, so a layer reading another tensor (or a plain layer reading this one) is left
    alone: correct whatever the module's forward does with its inputs. An owner without a forward of its own (a
    ModuleList) is never called, so nothing would clear what it holds: its layers convert their inputs alone."""

    def __init__(self, owner: nn.Module, tp_mesh):
        self.mesh = tp_mesh
        self.seen = []  # (local tensor, its replicated DTensor), for the current call of the owner
        self.active = type(owner).forward is not nn.Module.forward
        if self.active:
            owner.register_forward_pre_hook(self.clear)
            owner.register_forward_hook(self.clear)

    def clear(self, *_) -> None:
        self.seen.clear()

    def reader(self, layer: nn.Module) -> None:
        """Hand `layer` the shared DTensor of its input, before ColwiseParallel's own input hook runs."""
        if self.active:
            layer.register_forward_pre_hook(self.replicated, prepend=True)

    def replicated(self, layer: nn.Module, args: tuple) -> tuple | None:
        local = args[0]
        if isinstance(local, DTensor):
            return None
        shared = next((dtensor for tensor, dtensor in self.seen if tensor is local), None)
        if shared is None:
            shared = DTensor.from_local(local, self.mesh, (Replicate(),), run_check=False)
            self.seen.append((local, shared))
        return (shared, *args[1:])


def _shard_logits(model: nn.Module, tp_mesh) -> bool:
    if not hasattr(model, "get_output_embeddings"):  # a user's module: its _tp_plan says what is split
        return False
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    if not isinstance(head, nn.Linear) or (embedding is not None and head.weight is embedding.weight):
        return False
    parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                      use_local_output=False), src_data_rank=None)
    return True


def all_reduce_replicated_gradients(model: nn.Module, tp_group, device: torch.device) -> None:
    """Sum over the tp group the gradients of the weights kept whole whose gradient each rank computed from its
    own heads only (after the last backward of a step: the sum is linear, accumulation included). The sum runs
    on `device`, the group's: under plan.cpu_offload FSDP2 has moved the gradients to host memory, which NCCL
    cannot read."""
    for module in model.modules():
        if getattr(module, GRAD_ALL_REDUCE, False):
            for param in module.parameters(recurse=False):
                if param.grad is not None:
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    on_device = grad.to(device)
                    dist.all_reduce(on_device, group=tp_group)
                    if on_device is not grad:
                        grad.copy_(on_device)


def sync_rng(tp_mesh, device) -> None:
    """Give every rank of the tp group the random state of its first rank: dropout on the activations a tp group
    holds replicated must draw the same mask on every rank (after a resume at another mesh, each rank would
    otherwise continue a stream of its own)."""
    if tp_mesh is None:
        return
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, src=source, group=group)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(cuda_state, src=source, group=group)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
