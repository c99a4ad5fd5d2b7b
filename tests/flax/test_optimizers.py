"""Each optimizer `train.optimizer` names updates the same weights by the same gradients alike in torch (the cpu and
xla backends' builder) and optax (the flax backend's), decay masked to >= 2-D parameters on both."""
import numpy as np
import pytest
import torch

from portable_fsdp.backends.flax import optimizer as optax_optimizers
from portable_fsdp.backends.hf_torch.optimizer import build_optimizer
from tests.flax.conftest import make_config

SHAPES = {"w": (5, 7), "b": (7,), "e": (3, 4, 6)}
STEPS = 3


def _train_cfg(name: str, **fields):
    overrides = {"train.optimizer": name, "train.lr": 0.01, "train.weight_decay": 0.1, "train.momentum": 0.9, **fields}
    return make_config(overrides).train


def _trajectory(rng, params):
    return [{n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()} for _ in range(STEPS)]


def _torch_steps(train_cfg, params, grads, rates):
    tensors = {n: torch.tensor(p, requires_grad=True) for n, p in params.items()}
    optimizer = build_optimizer(((p, p.ndim) for p in tensors.values()), train_cfg, "cpu")
    for step_grads, lr in zip(grads, rates):
        for n, p in tensors.items():
            p.grad = torch.tensor(step_grads[n])
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return {n: p.detach().numpy() for n, p in tensors.items()}


def _optax_steps(train_cfg, params, grads, rates):
    import jax.numpy as jnp
    import optax

    transform = optax_optimizers.build(train_cfg)
    current = {n: jnp.asarray(p) for n, p in params.items()}
    state = transform.init(current)
    for step_grads, lr in zip(grads, rates):
        state = optax_optimizers.with_learning_rate(state, lr)
        updates, state = transform.update({n: jnp.asarray(g) for n, g in step_grads.items()}, state, current)
        current = optax.apply_updates(current, updates)
    return {n: np.asarray(p) for n, p in current.items()}


@pytest.mark.parametrize("name", ["adamw", "adafactor", "lion", "sgd"])
def test_torch_and_optax_take_the_same_steps(name):
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in SHAPES.items()}
    grads, rates = _trajectory(rng, params), [0.01, 0.02, 0.005]
    train_cfg = _train_cfg(name, **{"train.max_grad_norm": 0.0})
    expected, got = _torch_steps(train_cfg, params, grads, rates), _optax_steps(train_cfg, params, grads, rates)
    for n in params:
        assert not np.allclose(expected[n], params[n]), n  # the step moved every parameter
        np.testing.assert_allclose(got[n], expected[n], rtol=0, atol=1e-6, err_msg=n)


def test_adafactor_caps_its_step_size_like_torch():
    """torch's step size is min(lr, 1/sqrt(t)): a rate of 2 is cut to 1 at step 1, 0.71 at step 2."""
    rng = np.random.default_rng(1)
    params = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in SHAPES.items()}
    grads, rates = _trajectory(rng, params), [2.0, 2.0, 2.0]
    train_cfg = _train_cfg("adafactor", **{"train.max_grad_norm": 0.0, "train.weight_decay": 0.0})
    expected, got = _torch_steps(train_cfg, params, grads, rates), _optax_steps(train_cfg, params, grads, rates)
    for n in params:
        np.testing.assert_allclose(got[n], expected[n], rtol=0, atol=1e-5, err_msg=n)
