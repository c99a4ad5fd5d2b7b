"""A loss of the user's own on --backend flax (`loss(outputs, LossInputs) -> (sum, count)`): the step's loss is
Σ sum / Σ count over the accumulated global batch, its gradient that of Σ sum divided once by Σ count, and eval
returns both sums for the eval layer to divide."""
import numpy as np
import pytest

from tests.flax.conftest import flax_losses, init_state, make_config, needs_devices, train_batches
from tests.flax.test_parity import FP32_RTOL
from tests.flax.test_user_model import mlp
from tests.parity.reference import max_relative_difference

ACCUMULATED = {"train.grad_accum_steps": 2}


def cross_entropy(logits, labels):
    """Per-token cross-entropy, 0 where no token is predicted (IGNORE_INDEX)."""
    import jax
    import jax.numpy as jnp

    from portable_fsdp.data.batch import IGNORE_INDEX

    logits = logits.astype(jnp.float32)
    picked = jnp.sum(logits * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1)
    return jnp.where(labels != IGNORE_INDEX, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)


def token_mean(outputs, batch):
    """The built-in loss written as a user's: Σ token losses, Σ label tokens."""
    from portable_fsdp.data.batch import IGNORE_INDEX

    return cross_entropy(outputs, batch.labels).sum(), (batch.labels != IGNORE_INDEX).sum()


def weights(labels):
    """1, 2 or 3 per label token by its id, 0 elsewhere: a count that is not the label tokens'."""
    import jax.numpy as jnp

    from portable_fsdp.data.batch import IGNORE_INDEX

    return jnp.where(labels != IGNORE_INDEX, 1.0 + labels % 3, 0.0)


def weighted(outputs, batch):
    w = weights(batch.labels)
    return (w * cross_entropy(outputs, batch.labels)).sum(), w.sum()


def test_a_token_mean_of_ones_own_gives_the_built_in_losses():
    from portable_fsdp.training.parts import Parts

    built_in = flax_losses(make_config(ACCUMULATED), 1, 3)
    own = flax_losses(make_config(ACCUMULATED), 1, 3, Parts(loss=token_mean))
    assert max_relative_difference(own, built_in) <= FP32_RTOL


def test_a_weighted_count_divides_the_accumulated_sums_once():
    """Loss and update of one SGD step against a hand computation over both micro-batches."""
    import jax
    import optax

    from portable_fsdp.backends.flax import step
    from portable_fsdp.training.parts import Parts

    config = make_config({**ACCUMULATED, "train.max_grad_norm": 0.0})
    lr = 0.5
    parts = Parts(model=mlp(config.model.vocab_size), loss=weighted,
                  optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.0), schedule=lambda _: lr)
    state = init_state(config, 1, parts)
    before = {name: np.asarray(value) for name, value in state.params.items()}
    micro = train_batches(config).micro_batches(0, 0, 1)
    assert len(micro) == 2

    def by_hand(params):
        sums, counts = zip(*(weighted(state.ctx.model_def.forward(params, b.input_ids, step._positions(b))[0],
                                      b) for b in micro))
        return sum(sums) / sum(counts)

    expected_loss, expected_grads = jax.value_and_grad(by_hand)(before)
    state, metrics = step.train_step(state, micro)
    assert abs(metrics["loss"] - float(expected_loss)) <= 1e-6 * float(expected_loss)
    for name, value in state.params.items():
        np.testing.assert_allclose(np.asarray(value), before[name] - lr * np.asarray(expected_grads[name]),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@needs_devices(2)
@pytest.mark.parametrize("overrides", [{"plan.cp_size": 2}, {"plan.sp_size": 2}, {"plan.fsdp_size": 2}])
def test_a_weighted_count_is_the_same_over_sharded_rows_and_sequences(overrides):
    """The loss is traced on whole micro-batches: rows over fsdp, the sequence over cp or sp, change nothing."""
    from portable_fsdp.training.parts import Parts

    config = make_config(ACCUMULATED)
    one = flax_losses(config, 1, 3, Parts(model=mlp(config.model.vocab_size), loss=weighted))
    many = flax_losses(make_config({**ACCUMULATED, **overrides}), 2, 3,
                       Parts(model=mlp(config.model.vocab_size), loss=weighted))
    assert max_relative_difference(many, one) <= FP32_RTOL


def test_eval_and_predict_with_ones_own_loss_and_model():
    from portable_fsdp.backends.flax import step
    from portable_fsdp.data.batch import IGNORE_INDEX
    from portable_fsdp.training.parts import Parts

    config = make_config()
    state = init_state(config, 1, Parts(model=mlp(config.model.vocab_size), loss=weighted))
    batch = train_batches(config).micro_batches(0, 0, 1)[0]
    result = step.eval_step(state, batch, int((batch.labels != IGNORE_INDEX).sum()))
    assert set(result) == {"loss_sum", "count"}
    assert result["count"] == float(np.asarray(weights(batch.labels)).sum())
    assert "count" not in step.eval_step(init_state(config, 1), batch, 1)  # the built-in loss: tokens divide
    predicted = step.predict_step(state, batch, return_logits=True)
    assert predicted["predictions"].shape == batch.input_ids.shape
    assert predicted["logits"].shape == (*batch.input_ids.shape, config.model.vocab_size)
