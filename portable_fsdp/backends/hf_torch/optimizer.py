"""The optimizer update both torch-based lowerings (FSDP2 and torch_xla) share: the optimizer `train.optimizer`
names (portable_fsdp/training/optimizers.py) with decay only on parameters that are at least 2-D (not on norms),
or the one a user's factory makes; the learning rate set each step from the config's schedule or the user's, and
the step skipped or refused when the loss or the gradients are not finite."""
from __future__ import annotations

import torch

from portable_fsdp.backends.hf_torch.lion import Lion
from portable_fsdp.errors import UserError, require_finite
from portable_fsdp.training.parts import Parts
from portable_fsdp.training.schedule import for_config as schedule_for


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


def build_optimizer(params_with_ndim, train_cfg, device_type: str, factory=None) -> torch.optim.Optimizer:
    """`params_with_ndim`: (parameter, its logical rank) pairs — a flattened shard still decays by its
    original shape; `device_type`: where the parameters (and so the optimizer state) live, which picks the
    kernel; `factory`: a user's `params -> torch.optim.Optimizer`, given the trainable parameters in place of
    train.optimizer's. Created after wrapping, so its state is sharded too."""
    trainable = [(p, ndim) for p, ndim in params_with_ndim if p.requires_grad]
    if factory is not None:
        return _made_by(factory, [p for p, _ in trainable])
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


def _made_by(factory, params: list) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError("optimizer", (f"returned {type(optimizer).__name__}; pass a function of the parameters that "
                                      "returns a torch.optim.Optimizer, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"))
    return optimizer


def learning_rates(parts: Parts, train_cfg):
    """step -> learning rate: the user's schedule, else the config's (train.lr, warmup, lr_schedule)."""
    return parts.schedule or schedule_for(train_cfg)


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
