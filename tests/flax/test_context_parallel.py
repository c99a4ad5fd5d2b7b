"""plan.cp_size and plan.sp_size on flax: the sequence axis split over `cp` or `sp` devices (Ulysses SP exchanging
it for heads around attention). Losses, eval_loss and predictions are those of the unsplit model (the traps of
transformers#48167 and #48842: eval_loss times cp_size, predictions with cp_size times the rows). The losses
under cp and sp: the matrix's variants, tests/flax/test_parity.py."""
import numpy as np
import pytest

from tests.flax.conftest import init_state, make_config, needs_devices

pytestmark = needs_devices(2)


@pytest.mark.parametrize("axis", ["cp", pytest.param("sp", marks=pytest.mark.slow)])
def test_eval_loss_and_predictions_do_not_depend_on_the_sequence_split(axis):
    from jax.sharding import PartitionSpec as P

    from portable_fsdp.backends.flax import sharding, step
    from portable_fsdp.data.batch import EvalBatches
    from portable_fsdp.data.loader import build_token_data
    from portable_fsdp.training.evaluation import evaluate, token_accuracy

    config = make_config()
    data = build_token_data(config.data, config.model.vocab_size, 1)
    batches = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, config.train.eval_max_batches)
    results, predictions, trainers = {}, {}, {}
    for size in (1, 2):
        state = init_state(make_config({f"plan.{axis}_size": size}), 2)
        if size == 2:  # the sequence is split over the axis, parameters over it too (fsdp has size 1 here)
            assert state.ctx.mesh.shape[axis] == 2 and state.ctx.mesh.shape["fsdp"] == 1
            assert sharding.batch_sharding(state.ctx.mesh).spec == P(None, axis)
            assert state.params["lm_head.kernel"].sharding.spec == P(None, axis)
        results[size] = evaluate(step, state, batches, compute_metrics=token_accuracy)
        trainers[size] = evaluate(step, state, batches, compute_metrics=trainer_accuracy,
                                  preprocess_logits=lambda logits, labels: logits.argmax(-1))  # on jax arrays
        predictions[size] = step.predict_step(state, batches[0])
    assert results[2]["eval_tokens"] == results[1]["eval_tokens"]
    assert results[2]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-6)
    assert results[2]["eval_token_accuracy"] == results[1]["eval_token_accuracy"]
    assert trainers[2]["eval_accuracy"] == trainers[1]["eval_accuracy"]  # Hugging Face Trainer's convention
    assert predictions[2]["predictions"].shape == batches[0].input_ids.shape
    np.testing.assert_array_equal(predictions[2]["predictions"], predictions[1]["predictions"])


def trainer_accuracy(eval_pred):
    """A Hugging Face Trainer compute_metrics: label_ids are the inputs, shifted here."""
    predictions, labels = eval_pred.predictions[:, :-1], eval_pred.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predictions[mask] == labels[mask]).mean())}
