"""Hugging Face Trainer's compute_metrics(EvalPrediction) and preprocess_logits_for_metrics in the shared eval layer
(portable_fsdp/training/evaluation.py); under CP/SP on real ranks: tests/dist/test_eval_prediction.py."""
import numpy as np
import pytest

from portable_fsdp.data.batch import IGNORE_INDEX, as_batch
from portable_fsdp.training import evaluation
from tests.unit._helpers import user_error

VOCAB = 6


class LogitsBackend:
    """One process whose logits are the one-hot of each input token; records what predict_step is asked."""

    def __init__(self):
        self.calls = []

    def count_label_tokens(self, state, batch):
        return batch.num_label_tokens

    def eval_step(self, state, batch, num_items_in_batch):
        return {"loss_sum": float(num_items_in_batch)}

    def predict_step(self, state, batch, return_logits=False, preprocess_logits=None):
        self.calls.append((return_logits, preprocess_logits is not None, batch.labels.copy()))
        logits = np.eye(VOCAB, dtype=np.float32)[batch.input_ids]
        out = {"predictions": logits.argmax(-1), "labels": batch.labels}
        if preprocess_logits is not None:
            out["logits"] = preprocess_logits(logits, batch.labels)
        elif return_logits:
            out["logits"] = logits
        return out


def batches():
    """Two batches of rows of 5 tokens (inputs and labels of 4); the second's last row only pads."""
    rows = np.arange(15).reshape(3, 5) % VOCAB
    second = as_batch(rows[2:].repeat(2, axis=0))
    second.labels[1] = IGNORE_INDEX
    return [as_batch(rows[:2]), second]


def keep_eval_prediction(eval_pred):
    keep_eval_prediction.seen = eval_pred
    return {"rows": len(eval_pred.label_ids)}


def argmax(logits, labels):
    return logits.argmax(-1)


def our_metrics(predictions, labels):
    return {"rows": len(labels)}


def test_eval_prediction_holds_the_logits_and_trainers_labels():
    from transformers.trainer_utils import EvalPrediction

    data = batches()
    out = evaluation.evaluate(LogitsBackend(), None, data, compute_metrics=keep_eval_prediction)
    seen = keep_eval_prediction.seen
    assert isinstance(seen, EvalPrediction) and out["eval_rows"] == 3  # the padding row dropped
    inputs = np.concatenate([b.input_ids for b in data])[:3]
    assert seen.predictions.shape == (3, 4, VOCAB)
    assert (seen.predictions.argmax(-1) == inputs).all()
    # Trainer's causal-LM labels are the inputs themselves (the model shifts them); position 0 is no one's target
    assert (seen.label_ids[:, 1:] == inputs[:, 1:]).all() and (seen.label_ids[:, 0] == IGNORE_INDEX).all()


def test_preprocess_runs_per_batch_and_replaces_the_logits():
    backend = LogitsBackend()
    evaluation.evaluate(backend, None, batches(), compute_metrics=keep_eval_prediction, preprocess_logits=argmax)
    assert [(logits, preprocessed) for logits, preprocessed, _ in backend.calls] == [(True, True)] * 2
    assert keep_eval_prediction.seen.predictions.shape == (3, 4)  # argmax tokens, not logits


def test_our_convention_is_unchanged():
    backend = LogitsBackend()
    out = evaluation.evaluate(backend, None, batches(), compute_metrics=our_metrics)
    assert out["eval_rows"] == 3
    assert [(logits, preprocessed) for logits, preprocessed, _ in backend.calls] == [(False, False)] * 2
    assert (backend.calls[0][2] == batches()[0].labels).all()  # our labels, aligned with the predictions


def test_trainer_labels_shift_ours_by_one():
    labels = np.array([[5, 6, IGNORE_INDEX, 8]])
    assert evaluation.trainer_labels(labels).tolist() == [[IGNORE_INDEX, 5, 6, IGNORE_INDEX]]
    assert evaluation.trainer_labels(None) is None


def with_flag(eval_pred, compute_result=False):
    return {}


@pytest.mark.parametrize("fn, trainers", [(keep_eval_prediction, True), (with_flag, True), (our_metrics, False),
                                          (evaluation.token_accuracy, False)])
def test_convention_is_read_from_the_signature(fn, trainers):
    assert evaluation.takes_eval_prediction(fn) is trainers


@pytest.mark.parametrize("fn", [lambda *args: {}, lambda: {}, lambda a, b, c: {}])
def test_a_signature_that_tells_nothing_is_refused(fn):
    with user_error("train.compute_metrics", "give it one required argument (an EvalPrediction"):
        evaluation.takes_eval_prediction(fn)


def test_resolve_preprocess():
    here = "tests.unit.test_eval_prediction"
    trainers = evaluation.resolve_metrics(f"{here}:keep_eval_prediction")
    assert evaluation.resolve_preprocess(f"{here}:argmax", trainers) is argmax
    assert evaluation.resolve_preprocess("", trainers) is None
    for metrics in (None, evaluation.resolve_metrics(f"{here}:our_metrics")):
        with user_error("train.preprocess_logits_for_metrics", "reaches only a train.compute_metrics taking one"):
            evaluation.resolve_preprocess(f"{here}:argmax", metrics)
    with user_error("train.preprocess_logits_for_metrics", "cannot import 'nowhere_xyz:f'"):
        evaluation.resolve_preprocess("nowhere_xyz:f", trainers)
