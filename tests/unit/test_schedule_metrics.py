"""The learning-rate schedule, the FLOPs formula and the shared eval layer."""
import math

import numpy as np
import pytest

from portable_fsdp.training import evaluation, metrics, schedule
from portable_fsdp.backend import ModelInfo
from portable_fsdp.config.schema import base_config

LR = 1e-3


def lr_at(step, warmup=10, total=110, min_ratio=0.1):
    return schedule.learning_rate(step, lr=LR, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio)


# ---------------------------------------------------------------- schedule

@pytest.mark.parametrize("step, expected", [(0, LR / 10), (4, LR / 2), (9, LR)])
def test_linear_warmup(step, expected):
    assert lr_at(step) == pytest.approx(expected)


@pytest.mark.parametrize("step, cosine", [
    (10, 1.0),  # end of warm-up: the peak
    (35, 0.5 * (1 + math.cos(math.pi / 4))),
    (60, 0.5),  # half-way through the decay
    (85, 0.5 * (1 + math.cos(3 * math.pi / 4))),
    (110, 0.0),  # the end: min_lr_ratio * lr
    (500, 0.0),  # and it stays there
])
def test_cosine_decay(step, cosine):
    assert lr_at(step) == pytest.approx(LR * (0.1 + 0.9 * cosine))


def test_min_lr_ratio_bounds():
    assert lr_at(110, min_ratio=0.0) == pytest.approx(0.0)
    assert lr_at(60, min_ratio=1.0) == pytest.approx(LR)


def test_schedule_without_warmup_starts_at_peak():
    assert lr_at(0, warmup=0, total=100) == pytest.approx(LR)
    assert lr_at(50, warmup=0, total=100) == pytest.approx(LR * (0.1 + 0.9 * 0.5))


def test_schedule_warmup_as_long_as_training():
    assert [lr_at(s, warmup=10, total=10) for s in (0, 9)] == pytest.approx([LR / 10, LR])


def test_schedule_is_monotone():
    values = [lr_at(s) for s in range(120)]
    assert all(a < b for a, b in zip(values[:10], values[1:10]))
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


@pytest.mark.parametrize("step, remaining", [(10, 1.0), (35, 0.75), (60, 0.5), (110, 0.0), (500, 0.0)])
def test_linear_decay(step, remaining):
    lr = schedule.learning_rate(step, lr=LR, warmup_steps=10, total_steps=110, min_lr_ratio=0.1, shape="linear")
    assert lr == pytest.approx(LR * (0.1 + 0.9 * remaining))


def test_constant_after_warmup():
    rates = [schedule.learning_rate(s, lr=LR, warmup_steps=4, total_steps=20, min_lr_ratio=0.1, shape="constant")
             for s in (0, 3, 4, 19, 30)]
    assert rates == pytest.approx([LR / 4, LR, LR, LR, LR])


def test_wsd_is_constant_until_the_last_decay_ratio_then_linear():
    """torchtitan's warmup_stable_decay: 20 steps, decay_ratio 0.25 -> 5 decay steps from step 15, progress
    (step + 1 - 15) / 6, down to min_lr_ratio."""
    def rate(step):
        return schedule.learning_rate(step, lr=LR, warmup_steps=2, total_steps=20, min_lr_ratio=0.1, shape="wsd",
                                      decay_ratio=0.25)
    assert [rate(s) for s in (0, 1, 2, 14)] == pytest.approx([LR / 2, LR, LR, LR])
    assert [rate(s) for s in (15, 19, 25)] == pytest.approx([LR * (0.1 + 0.9 * 5 / 6), LR * (0.1 + 0.9 / 6), LR * 0.1])


def test_wsd_without_decay_is_constant():
    rates = {schedule.learning_rate(s, lr=LR, warmup_steps=0, total_steps=10, min_lr_ratio=0.0, shape="wsd")
             for s in range(10)}
    assert rates == {LR}


def test_for_config_reads_the_shape():
    train = base_config().train
    train.lr, train.warmup_steps, train.steps, train.min_lr_ratio, train.lr_schedule = 2.0, 0, 10, 0.0, "linear"
    assert schedule.for_config(train)(5) == pytest.approx(1.0)


def test_for_config_reads_train_fields():
    train = base_config().train
    train.lr, train.warmup_steps, train.steps, train.min_lr_ratio = 2.0, 4, 14, 0.5
    sched = schedule.for_config(train)
    assert sched(0) == pytest.approx(0.5)
    assert sched(9) == pytest.approx(2.0 * (0.5 + 0.5 * 0.5))


# ---------------------------------------------------------------- FLOPs

def model(n_params, n_layers, hidden_size, **fields):
    return ModelInfo((), (), n_params=n_params, n_layers=n_layers, hidden_size=hidden_size, vocab_size=1, **fields)


def test_flops_per_token_formula():
    assert metrics.flops_per_token(model(1_000_000, 4, 128), 256) == 6 * 1_000_000 + 12 * 4 * 128 * 256
    assert metrics.flops_per_token(model(0, 1, 1), 1) == 12.0
    assert isinstance(metrics.flops_per_token(model(1, 1, 1), 1), float)


def test_flops_per_token_scales_with_sequence_only_in_attention():
    a = metrics.flops_per_token(model(10_000, 2, 64), 128)
    b = metrics.flops_per_token(model(10_000, 2, 64), 256)
    assert b - a == 12 * 2 * 64 * 128


def test_a_mixture_of_experts_counts_the_routed_experts_a_token_runs_through():
    # 8 experts of 100 weights, 2 per token: 600 weights idle per token; the embedding table is a lookup
    moe = model(1000, 1, 1, n_embedding_params=50, n_routed_expert_params=800, num_experts=8, experts_per_token=2)
    assert moe.n_active_params == 1000 - 50 - 600
    assert metrics.flops_per_token(moe, 1) == 6 * 350 + 12
    # a model that does not say how many experts a token uses is counted whole, as a dense one
    assert model(1000, 1, 1, n_routed_expert_params=800, num_experts=8).n_active_params == 1000


def test_summary_aligns_keys():
    text = metrics.summary({"a": 1, "longer": "x"})
    assert text.splitlines() == ["  a       1", "  longer  x"]


# ---------------------------------------------------------------- evaluate

class FakeBackend:
    """A backend whose count_label_tokens / eval_step return preset, already-reduced numbers; records calls."""

    def __init__(self, outputs):
        self.outputs = list(outputs)  # (tokens, loss_sum) per batch
        self.seen = []

    def count_label_tokens(self, state, batch):
        return self.outputs[batch][0]

    def eval_step(self, state, batch, num_items_in_batch):
        self.seen.append((state, batch, num_items_in_batch))
        return {"loss_sum": self.outputs[batch][1]}

    def predict_step(self, state, batch):
        labels = np.full((2, 3), evaluation.IGNORE_INDEX if batch == 1 else 7)
        return {"predictions": np.full((2, 3), 7 if batch == 0 else 5), "labels": labels}


def test_evaluate_divides_once_over_all_tokens():
    # Per-batch means are 1.0 and 3.0 (their mean: 2.0); the token-weighted loss is (10 + 3) / (10 + 1).
    backend = FakeBackend([(10, 10.0), (1, 3.0)])
    out = evaluation.evaluate(backend, "state", [0, 1])
    assert out["eval_loss"] == pytest.approx(13 / 11)
    assert out["eval_tokens"] == 11
    assert out["perplexity"] == pytest.approx(math.exp(13 / 11))
    assert backend.seen == [("state", 0, 10), ("state", 1, 1)]  # the hook gets num_items_in_batch counted


def test_evaluate_ignores_empty_batches():
    assert evaluation.evaluate(FakeBackend([(0, 0.0), (4, 8.0)]), None, [0, 1])["eval_loss"] == pytest.approx(2.0)


def test_evaluate_caps_perplexity():
    out = evaluation.evaluate(FakeBackend([(1, 1000.0)]), None, [0])
    assert out["eval_loss"] == 1000.0 and out["perplexity"] == pytest.approx(math.exp(50.0))


@pytest.mark.parametrize("outputs", [[(0, 0.0)], []])
def test_evaluate_zero_tokens_raises(outputs):
    with pytest.raises(evaluation.UserError, match="no label tokens"):
        evaluation.evaluate(FakeBackend(outputs), None, range(len(outputs)))


def test_evaluate_user_eval_step_receives_num_items_in_batch():
    seen = []

    def my_step(state, batch, num_items_in_batch):
        seen.append(num_items_in_batch)
        return {"loss_sum": 2.0 * num_items_in_batch}

    out = evaluation.evaluate(FakeBackend([(3, 0.0), (5, 0.0)]), None, [0, 1], eval_step=my_step)
    assert seen == [3, 5] and out["eval_loss"] == pytest.approx(2.0)


def test_evaluate_compute_metrics_drops_padding_rows():
    out = evaluation.evaluate(FakeBackend([(6, 6.0), (0, 0.0)]), None, [0, 1],
                              compute_metrics=evaluation.token_accuracy)
    assert out["eval_token_accuracy"] == 1.0  # batch 1's rows are all padding: dropped


def test_resolve_metrics():
    assert evaluation.resolve_metrics("") is None
    assert evaluation.resolve_metrics("token_accuracy") is evaluation.token_accuracy
    assert evaluation.resolve_metrics("math:sqrt") is math.sqrt
    with pytest.raises(evaluation.UserError):
        evaluation.resolve_metrics("no_such_module_xyz:f")
