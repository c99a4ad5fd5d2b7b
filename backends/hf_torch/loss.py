"""The loss both torch-based lowerings train on, and its accumulation over micro-batches: Σ token losses
of the whole (accumulated, all-rank) batch, divided once by its label tokens — each backend counts the
tokens and picks the scale that turns its gradient reduction into that sum."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from portable_fsdp import faults
from portable_fsdp.data.loader import IGNORE_INDEX


def token_loss_sum(model: torch.nn.Module, input_ids, labels, position_ids) -> torch.Tensor:
    """Σ of token losses over this rank's tokens (labels were shifted before any sharding)."""
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def accumulate_gradients(micro_batches: list, forward, scale, *, rank: int, step: int,
                         sum_dtype: torch.dtype) -> torch.Tensor:
    """Forward and backward every micro-batch, gradients scaled by `scale`; returns Σ of their token-loss
    sums (detached, in `sum_dtype`) on this rank.

    `forward(index, micro_batch)` is the backend's context manager around one micro-batch: it yields that
    micro-batch's token-loss sum, and the backward runs inside it (where CP's sharding is still in place);
    whatever the backend does before or after a micro-batch (gradient sync, a graph cut) goes there too.
    `step` is the step being taken (1-based), for the injected non-finite loss of the fault tests."""
    total = None
    for index, batch in enumerate(micro_batches):
        with forward(index, batch) as batch_loss:
            if faults.poison_loss(rank, step):
                batch_loss = batch_loss * float("nan")
            (batch_loss * scale).backward()
            value = batch_loss.detach().to(sum_dtype)
            total = value if total is None else total + value
    return total
