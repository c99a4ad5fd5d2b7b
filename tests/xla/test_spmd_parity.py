"""SPMD FSDPv2 on 2 and 4 PJRT CPU devices against the single-process, unsharded torch reference:
20 per-step losses (plain, with gradient checkpointing, and with sequences split: fsdp 2 x cp 2 on 4
devices), real sharding of every parameter and input, a bounded number of compiled graphs, and a
SHARDED_STATE_DICT save that resumes exactly. Slow: the other plan variants on 2 devices."""
import re

import pytest

from tests.dist.fsdp_variants import make_config
from tests.parity.reference import max_relative_difference, reference_losses
from tests.xla.helpers import variants

STEPS = 20
FP32_RTOL = 1e-5
WARMUP_STEPS = 2  # the first steps compile (checkpointed layers trace one more graph on the second)
DEFAULT_VARIANTS = {2: ["base", "checkpointing"], 4: ["base", "checkpointing", "cp2"]}
CASES = [(devices, name) for devices, names in DEFAULT_VARIANTS.items() for name in names]
CASE_IDS = [f"{name} on {devices}" for devices, name in CASES]
SLOW_VARIANTS = {  # variant -> the reference's own overrides (the plan does not change the reference)
    "hf_grad_ckpt": {}, "size_based_wrap": {}, "no_wrap": {}, "tied": {"model.tie_word_embeddings": "true"},
    "batch8": {"train.batch_size": "8"}, "batch8_accum4": {"train.batch_size": "8"},
    "documents": {"data.document_masking": "true"}, "cp2": {}, "cp2_documents": {"data.document_masking": "true"},
}
# torch_xla's autocast (matmuls in bf16, fp32 master weights) moves the loss by less than a bf16 step.
BF16_RTOL = 2.0**-8


@pytest.fixture(scope="module")
def run_on(tmp_path_factory):
    """devices -> the results of DEFAULT_VARIANTS[devices], each device count run once."""
    cache = {}

    def results(devices: int) -> dict:
        if devices not in cache:
            cache[devices] = variants(tmp_path_factory.mktemp("spmd"), devices, STEPS, DEFAULT_VARIANTS[devices])
        return cache[devices]

    return results


@pytest.fixture(scope="module")
def reference():
    return reference_losses(make_config({}), STEPS)


def tile(spec: str) -> list:
    """'{devices=[2,1]0,1}' -> [2, 1]; replicated or unsharded -> []."""
    match = re.match(r"\{devices=\[([\d,]+)\]", spec)
    return [int(d) for d in match.group(1).split(",")] if match else []


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_losses_match_single_process_reference(run_on, reference, devices, name):
    losses = run_on(devices)[name]["losses"]
    assert len(losses) == STEPS
    assert max_relative_difference(losses, reference) <= FP32_RTOL


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_every_parameter_and_moment_is_sharded_over_all_devices(run_on, devices, name):
    result = run_on(devices)[name]
    assert len(result["shardings"]) == 21  # 2 layers x 9 + embedding, final norm, lm_head
    for param, spec in result["shardings"].items():
        dims = tile(spec)
        assert sorted(dims, reverse=True)[:2] in ([devices, 1], [devices]), f"{param}: {spec}"
        assert "last_tile_dim_replicate" not in spec, f"{param} is partly replicated: {spec}"
    assert result["moment_shardings"] == result["shardings"]  # AdamW state sharded like its parameter
    per_device = result["memory"]["state_mb"]
    assert len(per_device) == devices and max(per_device) <= 1.05 * min(per_device)


@pytest.mark.parametrize("devices,name", [(2, "base"), (4, "base"), (4, "cp2")], ids=["2", "4", "4 cp2"])
def test_inputs_are_sharded_by_row_and_with_cp_by_position(run_on, devices, name):
    cp = 2 if name == "cp2" else 1
    assert tile(run_on(devices)[name]["input_sharding"]) == [devices // cp, cp]


def test_eval_loss_is_the_same_with_sequences_split(run_on):
    results = run_on(4)
    assert results["cp2"]["initial_eval"]["eval_loss"] == pytest.approx(
        results["base"]["initial_eval"]["eval_loss"], abs=1e-6)


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_no_recompilation_after_warmup(run_on, devices, name):
    compiles = run_on(devices)[name]["compiles"][WARMUP_STEPS - 1:]
    assert len(set(compiles)) == 1, f"graphs compiled after warm-up: {compiles}"
    assert len(compiles) >= 10


def test_checkpoint_names_are_the_transformers_names(run_on):
    names = run_on(2)["base"]["names"]
    assert "model.layers.1.mlp.down_proj.weight" in names and "lm_head.weight" in names
    assert not any("_orig_module" in n for n in names)


def test_sharded_checkpoint_reloads_and_resumes_exactly(run_on):
    sharded = run_on(2)["base"]["sharded"]
    assert [f for f in sharded["files"] if f.startswith("sharded/device_")] == [
        "sharded/device_00000.safetensors", "sharded/device_00001.safetensors"]  # one file per device's shards
    assert sharded["fresh_eval"] != pytest.approx(sharded["saved_eval"], rel=1e-3)  # the load matters
    assert sharded["loaded_eval"] == sharded["saved_eval"]
    assert sharded["resumed"] == sharded["continued"]


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("slow"), 2, STEPS, [*SLOW_VARIANTS, "bf16"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_VARIANTS))
def test_plan_variants_match_reference(slow_results, name):
    reference = reference_losses(make_config(SLOW_VARIANTS[name]), STEPS)
    assert max_relative_difference(slow_results[name]["losses"], reference) <= FP32_RTOL


@pytest.mark.slow
def test_tied_embeddings_stay_tied(slow_results):
    assert slow_results["tied"]["tied"]


@pytest.mark.slow
def test_bf16_autocast_is_applied_and_close(slow_results):
    deviation = max_relative_difference(slow_results["bf16"]["losses"], reference_losses(make_config({}), STEPS))
    assert 1e-6 < deviation <= BF16_RTOL
