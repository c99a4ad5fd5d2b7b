"""A world of one rank trains the plain module (portable_fsdp/backends/torch/parallelize.shards): no FSDP2 module, no DTensor,
AdamW over the parameters themselves — and trains as the single-process reference does, with activation
checkpointing, bf16 autocast, CPU offload (without effect there: host memory already), rank-0 loading of tied
embeddings, accumulation; its eval_loss, predictions, memory report and FULL / SHARDED checkpoints work, and a
SHARDED checkpoint it writes resumes on 2 FSDP2 ranks."""
import json
import os

import numpy as np
import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.dist.eval_reference import check_eval_loss, check_predictions, reference_eval
from tests.dist.launch import torchrun
from tests.dist.single_rank_check import CASES
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

STEPS = 10
FP32_RTOL = 1e-5
HERE = os.path.dirname(__file__)


DEFAULT_CASES = ["plain", "bf16", "tied_rank0_loading"]
SLOW_CASES = [n for n in CASES if n not in DEFAULT_CASES]


def run_cases(tmp_dir, names: list) -> dict:
    out = tmp_dir / "results.json"
    torchrun(1, os.path.join(HERE, "single_rank_check.py"), str(out), str(STEPS), *names)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("single"), DEFAULT_CASES)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("single_slow"), SLOW_CASES)


def reference_for(name: str) -> list:
    return reference_losses(make_config({k: v for k, v in CASES[name].items() if not k.startswith("plan.")}), STEPS)


def check_plain_module(name: str, result: dict) -> None:
    assert result["fsdp_modules"] == 0 and result["dtensors"] == 0
    assert result["optimizer_holds_the_parameters"]
    assert result["checkpoint_wrappers"] == (2 if "plan.activation_checkpointing" in CASES[name] else 0)
    assert result["tied"] == ("model.tie_word_embeddings" in CASES[name])


def check_references(name: str, result: dict) -> None:
    if name == "bf16":  # autocast applied (not fp32's numbers), within a bf16 rounding step
        assert 1e-6 < max_relative_difference(result["losses"], reference_for(name)) <= 2.0**-8
        return
    assert max_relative_difference(result["losses"], reference_for(name)) <= FP32_RTOL
    assert result["gradient_deviation"] <= FP32_RTOL
    assert result["grad_norm"] == pytest.approx(result["reference_grad_norm"], rel=FP32_RTOL)
    if not any(key.startswith(("model.", "train.")) for key in CASES[name]):  # the eval reference's model
        check_eval_loss(result, reference_eval())
        check_predictions(result, reference_eval())


def check_round_trips(result: dict) -> None:
    assert result["full_eval_after"] == result["full_eval_before"]
    assert result["sharded_files"] == [".metadata", "__0_0.distcp"]
    assert result["fresh_eval"] != pytest.approx(result["sharded_eval_before"], rel=1e-3)  # the load matters
    assert result["sharded_eval_after"] == result["sharded_eval_before"]


@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_the_plain_module_trains_as_the_reference(results, name):
    check_plain_module(name, results[name])
    check_references(name, results[name])


@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_checkpoints_round_trip(results, name):
    check_round_trips(results[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_checkpointing_offload_and_accumulation_on_one_rank(slow_results, name):
    check_plain_module(name, slow_results[name])
    check_references(name, slow_results[name])
    check_round_trips(slow_results[name])


def test_the_memory_report_counts_the_whole_state(results):
    from portable_fsdp.backends.hf_torch.model import describe_model

    memory = results["plain"]["memory"]
    parameters_mb = describe_model(make_config({})).n_params * 4 / 2**20
    assert memory["state_mb"][0] == pytest.approx(3 * parameters_mb, rel=0.01)  # weights + Adam's two moments
    assert memory["grad_mb"][0] == pytest.approx(parameters_mb, rel=0.01)
    assert memory["mem_mb"][0] > memory["base_mem_mb"][0] > 0 and memory["peak_mem_mb"][0] > memory["base_mem_mb"][0]


@pytest.mark.slow
def test_a_sharded_checkpoint_of_one_rank_resumes_on_two(tmp_path):
    sharded = ["--config", TEST_RECIPE, "--config.train.log_every=1", "--workdir", str(tmp_path),
               "--config.plan.state_dict_type=SHARDED_STATE_DICT"]
    proc = cli([*sharded, "--nproc", "1", "--config.train.stop_at_step=10"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli([*sharded, "--nproc", "2", "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    reference = reference_losses(make_config({}), 20)
    assert sorted(losses) == list(range(1, 21))
    assert max_relative_difference([losses[s] for s in range(1, 21)], reference) <= FP32_RTOL
    assert np.isfinite(list(losses.values())).all()
