"""The optax update that equals the torch lowering's: clip_grad_norm_, then the torch optimizer `train.optimizer`
names (backends/hf_torch/optimizer.py build_optimizer).

- Clipping: torch's formula coef = max_norm / (norm + 1e-6), clamped to 1 (optax's own
  clip_by_global_norm divides by the norm without the 1e-6).
- AdamW: optax.adamw is torch's update — bias-corrected moments, eps added outside the square root,
  decay decoupled and scaled by the learning rate — with decay masked to >= 2-D parameters as in
  portable_fsdp/backends/hf_torch/optimizer.py build_optimizer.
- Lion: optax.lion is hf_torch/lion.py's update. SGD: torch adds the decay to the gradient before the momentum
  (L2), so add_decayed_weights comes before optax.sgd.
- Adafactor: torch.optim.Adafactor's definition rebuilt from optax's parts (`adafactor_like_torch`): optax.adafactor
  factors only dimensions of at least 128, decays weights without the learning rate and has no step-size cap.
- The learning rate is a hyperparameter set before every step from portable_fsdp.training.schedule (or the user's
  schedule), so both backends read the same number.
- A user's own optax transformation (portable_fsdp/training/parts.py) takes the named optimizer's place, after the
  same clipping; it must be made with optax.inject_hyperparams, so that its learning rate can be set.
Gradient accumulation is not optax.MultiSteps: that averages per micro-batch; step.py sums token
losses over the whole accumulated batch and divides once by its label-token count.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from portable_fsdp.errors import UserError

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


def scale_by_step_cap(learning_rate) -> optax.GradientTransformation:
    """Scale by torch Adafactor's step size min(lr, 1 / sqrt(t)), t the 1-based step."""
    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        step = (state.count + 1).astype(jnp.float32)
        rate = jnp.minimum(learning_rate, jax.lax.rsqrt(step))
        return jax.tree.map(lambda u: (u * rate).astype(u.dtype), updates), optax.ScaleByScheduleState(state.count + 1)

    return optax.GradientTransformation(init, update)


def adafactor_like_torch(learning_rate, weight_decay, mask) -> optax.GradientTransformation:
    """torch.optim.Adafactor with its defaults: every >= 2-D tensor factored over its last two dimensions' means, the
    second moment decaying as 1 - t^-0.8, the update clipped to RMS 1, scaled by max(1e-3, RMS(param)) and the capped
    step size, and decay p *= 1 - lr * weight_decay. torch clamps the variance at eps^2 where optax adds 1e-30 to
    the squared gradient: the two differ only for gradients near zero."""
    return optax.chain(
        optax.scale_by_factored_rms(min_dim_size_to_factor=1),
        optax.clip_by_block_rms(1.0),
        scale_by_step_cap(learning_rate),
        optax.scale_by_param_block_rms(1e-3),
        optax.scale(-1.0),
        optax.add_decayed_weights(-learning_rate * weight_decay, mask))


def sgd_like_torch(learning_rate, momentum, weight_decay, mask) -> optax.GradientTransformation:
    return optax.chain(optax.add_decayed_weights(weight_decay, mask),
                       optax.sgd(learning_rate, momentum=momentum or None))


def _named(train_cfg) -> optax.GradientTransformation:
    # `mask` is a function of the parameters, not a schedule: keep it out of the injected hyperparameters.
    t, inject = train_cfg, functools.partial(optax.inject_hyperparams, static_args=("mask",))
    if t.optimizer == "adafactor":
        return inject(adafactor_like_torch)(learning_rate=t.lr, weight_decay=t.weight_decay, mask=decays)
    if t.optimizer == "lion":
        return inject(optax.lion)(learning_rate=t.lr, b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decays)
    if t.optimizer == "sgd":
        # momentum 0 means no trace at all (a structural choice): static, like the mask
        return optax.inject_hyperparams(sgd_like_torch, static_args=("mask", "momentum"))(
            learning_rate=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, mask=decays)
    return inject(optax.adamw)(learning_rate=t.lr, b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay,
                               mask=decays)


def build(train_cfg, own: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
    """train.optimizer, or the user's own transformation `own`, after clipping as train.max_grad_norm says."""
    chosen = _named(train_cfg) if own is None else own
    if train_cfg.max_grad_norm > 0:
        return optax.chain(clip_by_global_norm_like_torch(train_cfg.max_grad_norm), chosen)
    return optax.chain(chosen)


def check_own(own, field: str = "optimizer") -> None:
    """A user's optimizer must be an optax transformation whose learning rate the step can set."""
    if not isinstance(own, optax.GradientTransformation):
        raise UserError(field, (f"{type(own).__name__} is not an optax GradientTransformation; --backend flax "
                                "takes one made with optax.inject_hyperparams, e.g. "
                                "optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)"))


def check_learning_rate(opt_state, field: str = "optimizer") -> None:
    """The schedule sets `learning_rate` before every step: the state must hold it (optax.inject_hyperparams
    keeps it in its state's hyperparams, also inside optax.chain or optax.MultiSteps)."""
    if not optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate"):
        raise UserError(field, ("has no learning_rate the schedule can set each step; wrap it with "
                                "optax.inject_hyperparams, e.g. "
                                "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)"))


def with_learning_rate(opt_state, lr):
    return optax.tree_utils.tree_set(opt_state, learning_rate=lr)


def adam_moments(opt_state) -> tuple:
    """(step count, first moments, second moments) of the AdamW part of the state."""
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    return adam.count, adam.mu, adam.nu


def replace_adam_moments(opt_state, count, mu: dict, nu: dict):
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    return optax.tree_utils.tree_set(opt_state, ScaleByAdamState=adam._replace(count=count, mu=mu, nu=nu))
