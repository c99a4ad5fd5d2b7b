"""Callbacks: the main process calls them, StopTraining ends a run, and EarlyStopping counts as Hugging Face's
EarlyStoppingCallback does."""
import pytest

from portable_fsdp.training.callbacks import Callbacks, EarlyStopping, StopTraining


def evals(callback, values, metric="eval_loss"):
    """The evaluation (1-based) at which `callback` stops, or None."""
    for i, value in enumerate(values, 1):
        try:
            callback.on_eval(None, {metric: value})
        except StopTraining:
            return i
    return None


@pytest.mark.parametrize("values, patience, min_delta, stops_at", [
    ([3.0, 2.0, 1.0, 0.5], 1, 0.0, None),       # improving every time
    ([3.0, 3.0, 3.1, 2.0], 2, 0.0, 3),          # two evals without a better value
    ([3.0, 2.95, 2.9, 2.85], 2, 0.1, 3),        # better, but not by more than min_delta
    ([3.0, 3.5, 2.0, 3.5, 3.5], 2, 0.0, 5),     # an improvement resets the count
])
def test_early_stopping_counts_evaluations_without_improvement(values, patience, min_delta, stops_at):
    assert evals(EarlyStopping(patience=patience, min_delta=min_delta), values) == stops_at


def test_early_stopping_on_a_metric_to_maximise():
    stop = EarlyStopping(metric="eval_accuracy", patience=1, greater_is_better=True)
    assert evals(stop, [0.5, 0.6, 0.55], metric="eval_accuracy") == 3


def test_only_the_main_process_calls_and_the_first_stop_wins():
    seen = []

    class Recorder:
        def on_step(self, state, metrics):
            seen.append(metrics["step"])

    class Stopper:
        def on_step(self, state, metrics):
            raise StopTraining("enough")

    assert Callbacks([Recorder(), Stopper()], is_main=True).call("on_step", None, {"step": 1}) == "enough"
    other_rank = Callbacks([Recorder(), Stopper()], is_main=False)
    assert other_rank.given and other_rank.call("on_step", None, {"step": 1}) is None
    assert seen == [1]
    assert Callbacks([Recorder()], is_main=True).call("on_eval", None, {}) is None  # a hook it lacks: skipped
