"""The optimizer update both torch-based lowerings (FSDP2 and torch_xla) share: AdamW with decay only
on parameters that are at least 2-D (not on norms), the learning rate set each step, and the step
skipped or refused when the loss or the gradients are not finite."""
from __future__ import annotations

import torch

from portable_fsdp.errors import require_finite


def build_adamw(params_with_ndim, train_cfg) -> torch.optim.Optimizer:
    """`params_with_ndim`: (parameter, its logical rank) pairs — a flattened shard still decays by its
    original shape. Created after wrapping, so its state is sharded too."""
    trainable = [(p, ndim) for p, ndim in params_with_ndim if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p, ndim in trainable if ndim >= 2], "weight_decay": train_cfg.weight_decay},
                              {"params": [p for p, ndim in trainable if ndim < 2], "weight_decay": 0.0}],
                             lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
                             foreach=False, fused=False)  # no fused kernels: they reject xla tensors


def apply_update(optimizer: torch.optim.Optimizer, lr: float, loss: float, grad_norm: float, step: int,
                 nonfinite: str) -> bool:
    """Apply the gradients at `lr` unless the loss or norm is not finite; returns whether it applied."""
    finite = require_finite(step, loss, grad_norm, nonfinite)
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return finite
