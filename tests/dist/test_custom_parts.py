"""A user's own parts on the cpu lowering (FSDP2 over gloo, 2 ranks): a non-transformers module built on the meta
device or built whole, a loss that counts its own tokens, an optimizer factory and a schedule, each against one
plain-torch process (tests/parity/custom_parts.py); a custom token-mean loss against the built-in one; a resume of
a custom module and optimizer, bit for bit. The default suite runs one scenario per part; `slow` the rest."""
import json
import os

import pytest

from tests.dist.launch import torchrun
from tests.parity.custom_parts import reference_losses
from tests.parity.reference import max_relative_difference

HERE = os.path.dirname(__file__)
STEPS = 8
FP32_RTOL = 1e-5  # a sharded run against one process (tests/dist/test_fsdp_parity.py)
SAME_LOSS_RTOL = 1e-6  # the built-in loss and a custom loss computing the same: only the rounding differs
DEFAULT = ["mlp_meta", "mlp_parts", "token_mean_accum2", "builtin_accum2", "weighted_cp2", "resume_full"]
SLOW = ["mlp_built", "mlp_tp2", "builtin", "token_mean", "builtin_cp2", "token_mean_cp2", "resume_sharded"]


def run(tmp_path, names: list) -> dict:
    out = tmp_path / "custom_parts.json"
    torchrun(2, os.path.join(HERE, "custom_parts_check.py"), str(out), str(STEPS), *names)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(tmp_path_factory.mktemp("custom_parts"), DEFAULT)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    return run(tmp_path_factory.mktemp("custom_parts_slow"), SLOW)


def check_against_one_process(result: dict, name: str) -> None:
    reference = reference_losses(name, STEPS)
    assert max_relative_difference(result["losses"], reference["losses"]) <= FP32_RTOL
    assert result["lrs"] == reference["lrs"]


@pytest.mark.parametrize("name", ["mlp_meta", "mlp_parts", "token_mean_accum2", "weighted_cp2"])
def test_custom_parts_match_one_process(results, name):
    """mlp_meta: the module on the meta device, filled shard by shard, with the built-in loss and optimizer;
    mlp_parts: with a custom loss, SGD with momentum and a schedule; token_mean_accum2: a custom loss under
    accumulation; weighted_cp2: a loss whose count is not the label tokens, under context parallelism."""
    check_against_one_process(results[name], name)


def test_schedule_sets_the_learning_rate(results):
    assert results["mlp_parts"]["lrs"] == [0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125]


def test_custom_token_mean_loss_gives_the_builtin_losses(results):
    assert max_relative_difference(results["token_mean_accum2"]["losses"],
                                   results["builtin_accum2"]["losses"]) <= SAME_LOSS_RTOL


def test_full_checkpoint_of_custom_parts_resumes_bit_exactly(results):
    result = results["resume_full"]
    assert result["resumed"] == result["straight"]
    assert "model.safetensors" in result["files"] and "optimizer.pt" in result["files"]
    assert "config.json" not in result["files"]  # a user's module has no transformers config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp_built", "mlp_tp2", "builtin", "token_mean", "builtin_cp2", "token_mean_cp2"])
def test_more_custom_parts_match_one_process(slow_results, name):
    check_against_one_process(slow_results[name], name)


@pytest.mark.slow
def test_a_custom_modules_tp_plan_splits_it(slow_results):
    assert sorted(slow_results["mlp_tp2"]["split_over_tp"]) == sorted(
        f"layers.{i}.{name}" for i in range(2) for name in ("up.weight", "up.bias", "down.weight"))


@pytest.mark.slow
@pytest.mark.parametrize("custom, builtin", [("token_mean", "builtin"), ("token_mean_cp2", "builtin_cp2")])
def test_custom_token_mean_loss_gives_the_builtin_losses_everywhere(slow_results, custom, builtin):
    assert max_relative_difference(slow_results[custom]["losses"], slow_results[builtin]["losses"]) <= SAME_LOSS_RTOL


@pytest.mark.slow
def test_sharded_checkpoint_of_custom_parts_resumes_bit_exactly(slow_results):
    result = slow_results["resume_sharded"]
    assert result["resumed"] == result["straight"]
