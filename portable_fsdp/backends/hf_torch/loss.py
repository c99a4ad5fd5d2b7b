"""The loss both torch-based lowerings train on, and its accumulation over micro-batches: Σ token losses
of the whole (accumulated, all-rank) batch, divided once by its label tokens — each backend counts the
tokens and picks the scale that turns its gradient reduction into that sum. A mixture-of-experts model whose
config sets `output_router_logits` adds its router's load-balancing loss, as its own forward does, over the
whole batch (`RouterLoss`).

A user's loss (`Objective.loss`: loss(outputs, LossInputs) -> (sum, count)) has its count only after the
forward: its sums are backpropagated unscaled, and the backend divides the gradients once by the global count
(`divide_gradients`) before clipping."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from portable_fsdp.training import faults
from portable_fsdp.backends.hf_torch import chunked_loss
from portable_fsdp.backends.hf_torch.custom_model import logits_of, transformers_forward
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.errors import UserError
from portable_fsdp.training.parts import LossInputs


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    """How a training step counts the router's load-balancing loss: over the rows of every rank of a micro-batch,
    averaged over the step's micro-batches. `weight` is what one unit of it adds to the token-loss sum (the
    step's label tokens over its micro-batches, as that sum is divided by the tokens once); `all_reduce` sums a
    tensor over the ranks, in place and returning it, each token counted once."""

    weight: float
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


def token_loss_sum(model: torch.nn.Module, input_ids, labels, position_ids,
                   router: RouterLoss | None = None) -> torch.Tensor:
    """Σ of token losses over this rank's tokens (labels were shifted before any sharding); with `router`, plus
    this rank's share of the load-balancing loss when the model returns router logits. With a chunked loss
    installed (chunked_loss.install), the model's output projection computes the sum a chunk of tokens at a
    time inside the model's call, never the whole micro-batch's logits."""
    chunked = chunked_loss.installed(model)
    with chunked_loss.labels_for(chunked, labels):
        outputs = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    if chunked is not None:
        loss = chunked_loss.loss_from(chunked, model, outputs.logits)
    else:
        loss = cross_entropy_sum(outputs.logits, labels)
    router_logits = getattr(outputs, "router_logits", None)
    if router is not None and router_logits:
        share = load_balancing_share(router_logits, model.num_experts, model.num_experts_per_tok, router.all_reduce)
        # the model's own formula: loss + router_aux_loss_coef * aux_loss (on the local value of a loss that
        # tensor parallelism's loss_parallel leaves replicated)
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        loss = loss + router.weight * model.router_aux_loss_coef * share
    return loss


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a step's forward computes on this rank's tokens. `forward(model, input_ids, position_ids)`: a user's
    module's call (custom_model.Forward), None for a transformers model (the chunked loss and the router loss
    apply). `loss`: a user's loss(outputs, LossInputs) -> (sum, count), None for the built-in Σ cross-entropy,
    whose count (the label tokens) the backend knows before the forward."""

    forward: Callable | None = None
    loss: Callable | None = None

    def __call__(self, model, input_ids, labels, position_ids, router: RouterLoss | None = None) -> tuple:
        """(Σ loss over this rank's tokens, their count: a tensor, or None for the built-in loss)."""
        if self.forward is None and self.loss is None:
            return token_loss_sum(model, input_ids, labels, position_ids, router), None
        outputs = self.outputs(model, input_ids, position_ids)
        if self.loss is None:
            return cross_entropy_sum(logits_of(outputs), labels), None
        return _sum_and_count(self.loss(outputs, LossInputs(input_ids, labels, position_ids)), labels.device)

    def outputs(self, model, input_ids, position_ids):
        """What the model returns for these tokens (logits, or an object holding them)."""
        return (self.forward or transformers_forward)(model, input_ids, position_ids)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _sum_and_count(result, device) -> tuple:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        raise UserError("loss", (f"returned {type(result).__name__}; a loss returns (sum, count): a tensor summing "
                                 "its per-token losses over the batch it is given, and how many it counted"))
    total, count = result
    count = count.detach() if isinstance(count, torch.Tensor) else torch.tensor(float(count), device=device)
    return total, count


def divide_gradients(parameters, count) -> None:
    """Every gradient (summed, unscaled, over micro-batches and ranks) divided by a user's loss's global count:
    the gradient of Σ sum / Σ count. `count` a number or a device scalar."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).div_(count)


def load_balancing_share(router_logits: tuple, num_experts: int, top_k: int, all_reduce) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the batch of every rank, as transformers'
    `load_balancing_loss_func` computes it over one batch (no attention mask): E · Σ_e f_e · P_e, with f_e the
    fraction of the top-k choices that went to expert e and P_e its mean router probability, both over every
    layer's rows. f_e takes no gradient: it is counted over all ranks (one all-reduce of the choices per expert
    and the rows), and each rank returns E · Σ_e f_e · (its own Σ probabilities of e) / all rows — the shares
    add up over the ranks to the loss of the whole batch, their gradients to its gradient (a loss computed per
    rank and averaged would not: f and P are means over the batch)."""
    device = router_logits[0].device
    chosen = torch.zeros(num_experts, dtype=torch.float64, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for layer_logits in router_logits:
        routing = torch.softmax(layer_logits, dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)
        # a count of fixed shape (bincount's depends on the values): XLA compiles it once, the estimate traces it
        choices = selected.reshape(-1)
        chosen.index_add_(0, choices, torch.ones(choices.numel(), dtype=chosen.dtype, device=device))
        probabilities = probabilities + routing.float().sum(dim=0)
        rows += routing.shape[0]
    totals = all_reduce(torch.cat([chosen, chosen.new_tensor([rows])]))
    fractions = (totals[:num_experts] / totals[num_experts]).float()
    return num_experts * (fractions * probabilities).sum() / totals[num_experts].float()


def accumulate_gradients(micro_batches: list, forward, scale, *, rank: int, step: int,
                         sum_dtype: torch.dtype) -> tuple:
    """Forward and backward every micro-batch, gradients scaled by `scale`; returns (Σ of their loss sums,
    Σ of their counts or None: the built-in loss) on this rank, detached, in `sum_dtype`.

    `forward(index, micro_batch)` is the backend's context manager around one micro-batch: it yields that
    micro-batch's (loss sum, count or None) (`Objective`), and the backward runs inside it (where CP's sharding
    is still in place); whatever the backend does before or after a micro-batch (gradient sync, a graph cut) goes
    there too. `step` is the step being taken (1-based), for the injected non-finite loss of the fault tests."""
    total = counted = None
    for index, batch in enumerate(micro_batches):
        with forward(index, batch) as (batch_loss, count):
            if faults.poison_loss(rank, step):
                batch_loss = batch_loss * float("nan")
            (batch_loss * scale).backward()
            value = batch_loss.detach().to(sum_dtype)
            total = value if total is None else total + value
            if count is not None:
                counted = count.to(sum_dtype) if counted is None else counted + count.to(sum_dtype)
    return total, counted
