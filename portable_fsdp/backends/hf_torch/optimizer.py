"""The optimizer update both torch-based lowerings (FSDP2 and torch_xla) share: the optimizer `train.optimizer`
names (portable_fsdp/training/optimizers.py) with decay only on parameters that are at least 2-D (not on norms),
the learning rate set each step, and the step skipped or refused when the loss or the gradients are not finite."""
from __future__ import annotations

import torch

from portable_fsdp.backends.hf_torch.lion import Lion
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


def build_optimizer(params_with_ndim, train_cfg, device_type: str) -> torch.optim.Optimizer:
    """`params_with_ndim`: (parameter, its logical rank) pairs — a flattened shard still decays by its
    original shape; `device_type`: where the parameters (and so the optimizer state) live, which picks the
    kernel. Created after wrapping, so its state is sharded too."""
    trainable = [(p, ndim) for p, ndim in params_with_ndim if p.requires_grad]
    groups = [{"params": [p for p, ndim in trainable if ndim >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p, ndim in trainable if ndim < 2], "weight_decay": 0.0}]
    t = train_cfg
    if t.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=t.lr, foreach=device_type != "xla")
    if t.optimizer == "lion":
        return Lion(groups, lr=t.lr, betas=(t.beta1, t.beta2))
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum, foreach=device_type != "xla")
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_kernel(device_type))


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
