"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), which torch.optim lacks: the update is
the sign of an interpolation of the momentum and the gradient, with decoupled weight decay — optax.lion's
definition, so the flax backend's update is the same."""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = torch.sign(exp_avg * beta1 + p.grad * (1 - beta1))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                exp_avg.lerp_(p.grad, 1 - beta2)
        return loss
