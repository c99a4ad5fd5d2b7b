"""A single-process, unsharded training loop written with plain torch: the yardstick every
sharded run is compared to. It shares only the model constructor and the data with the code under
test; the loss, the backward, the clipping and the optimizer step are torch's own. A mixture-of-experts model
whose config sets `output_router_logits` adds its router's load-balancing loss (`aux_loss`, over the whole
batch of the step) as its own forward does when given labels."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from portable_fsdp.backends.hf_torch.model import create_model
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.training.schedule import for_config


def reference_losses(config, steps: int, dtype: torch.dtype = torch.float32, model=None) -> list:
    """One process's per-step losses; `model`: the unsharded model to train instead of the config's (AdamW
    updates only the parameters that get gradients)."""
    model = (model or create_model(config, rank=0, rank0_only=False)).to(dtype)
    t = config.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    data = build_token_data(config.data, config.model.vocab_size, t.batch_size)
    documents_end_at = data.eos_token_id if config.data.document_masking else None
    batches = TrainBatches(data.train, t.batch_size, 1, config.seed, documents_end_at)
    schedule = for_config(t)
    losses = []
    for step in range(steps):
        (batch,) = batches.micro_batches(step, 0, 1)
        input_ids = torch.from_numpy(batch.input_ids)
        labels = torch.from_numpy(batch.labels)
        positions = None if batch.position_ids is None else torch.from_numpy(batch.position_ids)
        outputs = model(input_ids=input_ids, position_ids=positions, use_cache=False)
        loss = F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        if getattr(outputs, "aux_loss", None) is not None:  # a MoE model whose config sets output_router_logits
            loss = loss + model.router_aux_loss_coef * outputs.aux_loss  # as the model's own forward adds it
        loss.backward()
        take_step(model, optimizer, t.max_grad_norm, schedule(step))
        losses.append(loss.item())
    return losses


def take_step(model, optimizer, max_grad_norm: float, lr: float) -> None:
    """The update after a backward, as every backend takes it: clip to max_grad_norm (when > 0), set lr, step."""
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def max_relative_difference(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def reference_gradients(config, batch) -> dict:
    """{parameter name: gradient} of the mean token loss of `batch` (one micro-batch of the whole global batch)
    on the unsharded model at init, and their global L2 norm under the key None."""
    model = create_model(config, rank=0, rank0_only=False)
    positions = None if batch.position_ids is None else torch.from_numpy(batch.position_ids)
    logits = model(input_ids=torch.from_numpy(batch.input_ids), position_ids=positions, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), torch.from_numpy(batch.labels).flatten(),
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grads[None] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    return grads
