"""A user's parts on the xla backend (SPMD FSDPv2 over 2 PJRT CPU devices): a non-transformers module built on the
meta device with a custom loss, SGD with momentum and a schedule, against one plain-torch process (as the cpu
backend is: tests/dist/test_custom_parts.py); a FULL checkpoint of a custom module resumed bit for bit (AdamW,
whose state xla's checkpoints keep); the refusals of what xla cannot take. Slow: a module built on the CPU, and
custom losses on the transformers model under accumulation and context parallelism."""
import pytest

from tests.parity.custom_parts import reference_losses
from tests.parity.reference import max_relative_difference
from tests.xla.helpers import run_script

STEPS = 8
FP32_RTOL = 1e-5  # the xla parity bar (tests/xla/test_spmd_parity.py)


def run(tmp_path, names: list) -> dict:
    import json

    out = tmp_path / "custom_parts.json"
    run_script("custom_parts_check.py", [out, 2, STEPS, *names], timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(tmp_path_factory.mktemp("xla_custom"), ["refusals", "mlp_parts", "resume_full"])


def test_custom_module_loss_optimizer_and_schedule_match_one_process(results):
    result, reference = results["mlp_parts"], reference_losses("mlp_parts", STEPS)
    assert max_relative_difference(result["losses"], reference["losses"]) <= FP32_RTOL
    assert result["lrs"] == reference["lrs"]
    matrices = {name: spec for name, spec in result["shardings"].items() if name.endswith(("embed.weight", "up.weight",
                                                                                          "down.weight", "head.weight"))}
    assert len(matrices) == 6 and all(spec.startswith("{devices=[") for spec in matrices.values()), matrices


def test_full_checkpoint_of_a_custom_module_resumes_bit_exactly(results):
    result = results["resume_full"]
    assert result["resumed"] == result["straight"]
    assert "model.safetensors" in result["files"] and "config.json" not in result["files"]


def test_fsdp_v1_refuses_parts_in_one_line(results):
    assert results["refusals"]["fsdp_v1"] == (
        "plan.xla_fsdp_v2: is false, and FSDP v1's processes cannot receive the model, loss, optimizer, schedule "
        "passed in: set plan.xla_fsdp_v2=true (SPMD), which trains them in this process")


def test_an_optimizer_passed_in_is_saved_full_only(results):
    assert results["refusals"]["sharded_optimizer"].startswith(
        "plan.state_dict_type: SHARDED_STATE_DICT on xla holds AdamW's moments only, not an optimizer passed in")
    assert results["refusals"]["full_optimizer"] == [
        "optimizer: xla's FULL checkpoints hold AdamW's state only: a resume restores the weights and the step, and "
        "this optimizer's state starts afresh"]


SLOW = ["mlp_built", "token_mean_accum2", "weighted_cp2"]


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    return run(tmp_path_factory.mktemp("xla_custom_slow"), SLOW)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_more_custom_parts_match_one_process(slow_results, name):
    """A module built on the CPU; a custom loss on the transformers model under accumulation, and one with another
    count under context parallelism."""
    reference = reference_losses(name, STEPS)["losses"]
    assert max_relative_difference(slow_results[name]["losses"], reference) <= FP32_RTOL
