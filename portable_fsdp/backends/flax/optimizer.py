"""The optax update that equals the torch lowering's: clip_grad_norm_, then torch.optim.AdamW.

- Clipping: torch's formula coef = max_norm / (norm + 1e-6), clamped to 1 (optax's own
  clip_by_global_norm divides by the norm without the 1e-6).
- AdamW: optax.adamw is torch's update — bias-corrected moments, eps added outside the square root,
  decay decoupled and scaled by the learning rate — with decay masked to >= 2-D parameters as in
  portable_fsdp/backends/hf_torch/optimizer.py build_adamw.
- The learning rate is a hyperparameter set before every step from portable_fsdp.training.schedule, so both
  backends read the same number.
Gradient accumulation is not optax.MultiSteps: that averages per micro-batch; step.py sums token
losses over the whole accumulated batch and divides once by its label-token count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

TORCH_CLIP_EPS = 1e-6


def clip_by_global_norm_like_torch(max_norm: float) -> optax.GradientTransformation:
    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        coef = jnp.minimum(max_norm / (optax.tree.norm(updates) + TORCH_CLIP_EPS), 1.0)
        return jax.tree.map(lambda g: (g * coef).astype(g.dtype), updates), state

    return optax.GradientTransformation(init, update)


def decays(params: dict) -> dict:
    """Weight decay applies to matrices only (not to norm scales or biases)."""
    return {name: p.ndim >= 2 for name, p in params.items()}


def build(train_cfg) -> optax.GradientTransformation:
    # `mask` is a function of the parameters, not a schedule: keep it out of the injected hyperparameters.
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=train_cfg.lr, b1=train_cfg.beta1, b2=train_cfg.beta2, eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay, mask=decays)
    if train_cfg.max_grad_norm > 0:
        return optax.chain(clip_by_global_norm_like_torch(train_cfg.max_grad_norm), adamw)
    return optax.chain(adamw)


def with_learning_rate(opt_state, lr):
    return optax.tree_utils.tree_set(opt_state, learning_rate=lr)


def adam_moments(opt_state) -> tuple:
    """(step count, first moments, second moments) of the AdamW part of the state."""
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    return adam.count, adam.mu, adam.nu


def replace_adam_moments(opt_state, count, mu: dict, nu: dict):
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    return optax.tree_utils.tree_set(opt_state, ScaleByAdamState=adam._replace(count=count, mu=mu, nu=nu))
