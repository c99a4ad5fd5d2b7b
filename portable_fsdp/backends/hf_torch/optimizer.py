"""The optimizer update both torch-based lowerings (FSDP2 and torch_xla) share: AdamW with decay only
on parameters that are at least 2-D (not on norms), the learning rate set each step, and the step
skipped or refused when the loss or the gradients are not finite."""
from __future__ import annotations

import torch

from portable_fsdp.errors import require_finite


def adamw_kernel(device_type: str) -> dict:
    """AdamW's implementation for parameters on `device_type`: the fused kernel on cuda, else the multi-tensor
    (foreach) one. xla gets the single-tensor loop: the fused and foreach kernels reject or mishandle xla
    tensors. On cpu foreach gives the loop's numbers bit for bit in fewer dispatches; torch's fused cpu kernel
    rounds differently, so cpu runs would drift from the loop's."""
    if device_type == "xla":
        return {"foreach": False, "fused": False}
    if device_type == "cuda":
        return {"foreach": False, "fused": True}
    return {"foreach": True, "fused": False}


def build_adamw(params_with_ndim, train_cfg, device_type: str) -> torch.optim.Optimizer:
    """`params_with_ndim`: (parameter, its logical rank) pairs — a flattened shard still decays by its
    original shape; `device_type`: where the parameters (and so the optimizer state) live, which picks the
    kernel. Created after wrapping, so its state is sharded too."""
    trainable = [(p, ndim) for p, ndim in params_with_ndim if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p, ndim in trainable if ndim >= 2], "weight_decay": train_cfg.weight_decay},
                              {"params": [p for p, ndim in trainable if ndim < 2], "weight_decay": 0.0}],
                             lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
                             **adamw_kernel(device_type))


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
