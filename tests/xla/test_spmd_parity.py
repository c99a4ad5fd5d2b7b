"""SPMD FSDPv2 on 2 and 4 PJRT CPU devices against the single-process, unsharded torch reference:
20 per-step losses (plain, with gradient checkpointing, with sequences split: fsdp 2 x cp 2, and with
tensor parallelism: fsdp 2 x tp 2 on 4 devices), eval_loss before training against the plain-torch model's,
real sharding of every parameter and input, a bounded number of compiled graphs, and a SHARDED_STATE_DICT save
that resumes exactly. Slow: the rest of the matrix (tests/parity/matrix.py) that the xla lowering honours —
Ulysses sequence parallelism, HSDP, tensor parallelism alone with a FULL checkpoint resumed without it — and
expert parallelism on a tiny Mixtral (fsdp 4 = 2 x ep 2, and fsdp 2 x tp 2 with ep 4 over all of them)."""
import json
import math
import re

import pytest

from tests.parity import families
from tests.parity.matrix import VARIANTS, make_config, variants_for
from tests.parity.reference import max_relative_difference, reference_losses
from tests.xla.helpers import variants

STEPS = 20
FP32_RTOL = 1e-5
EVAL_RTOL = 1e-6  # eval_loss: Σ token losses (fp32 on the device) / Σ label tokens, against the plain-torch model's
WARMUP_STEPS = 2  # the first steps compile (checkpointed layers trace one more graph on the second)
# The SPMD variants of the matrix the xla lowering runs by default, by device count (FSDP v1: test_fsdp_v1.py).
DEFAULT_VARIANTS = {devices: variants_for("xla", world=devices) for devices in (2, 4)}
CASES = [(devices, name) for devices, names in DEFAULT_VARIANTS.items() for name in names]
CASE_IDS = [f"{name} on {devices}" for devices, name in CASES]
SLOW_VARIANTS = {devices: variants_for("xla", slow=True, world=devices) for devices in (2, 4)}
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


_references: dict = {}


def reference_for(name: str) -> list:
    overrides = VARIANTS[name].reference_overrides
    key = repr(sorted(overrides.items()))
    if key not in _references:
        _references[key] = reference_losses(make_config(overrides), STEPS)
    return _references[key]


def tile(spec: str) -> list:
    """'{devices=[2,1]0,1}' -> [2, 1]; replicated or unsharded -> []."""
    match = re.match(r"\{devices=\[([\d,]+)\]", spec)
    return [int(d) for d in match.group(1).split(",")] if match else []


def distinct_shards(spec: str) -> int:
    """How many different pieces a tensor is cut into (a trailing replication dimension cuts nothing)."""
    dims = tile(spec)
    if "last_tile_dim_replicate" in spec:
        dims = dims[:-1]
    return math.prod(dims)


def replicas(name: str) -> int:
    return int(VARIANTS[name].overrides.get("plan.dp_replicate_size", 1))


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_losses_match_single_process_reference(run_on, devices, name):
    losses = run_on(devices)[name]["losses"]
    assert len(losses) == STEPS
    assert max_relative_difference(losses, reference_for(name)) <= FP32_RTOL


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_eval_loss_is_the_plain_torch_models(run_on, devices, name):
    result = run_on(devices)[name]
    assert result["initial_eval"]["eval_loss"] == pytest.approx(result["plain_eval"], rel=EVAL_RTOL)


def assert_spread_over_every_device_of_a_replica(result: dict, devices: int, replicas: int) -> None:
    assert len(result["shardings"]) == 21  # 2 layers x 9 + embedding, final norm, lm_head
    for param, spec in result["shardings"].items():
        if param.endswith("norm.weight"):  # [64]: too small to split (portable_fsdp/placement.py), whole
            assert spec == "{replicated}", f"{param}: {spec}"
            continue
        assert distinct_shards(spec) == devices // replicas, f"{param}: {spec}"
        assert ("last_tile_dim_replicate" in spec) == (replicas > 1), f"{param}: {spec}"
    assert result["moment_shardings"] == result["shardings"]  # AdamW state sharded like its parameter
    per_device = result["memory"]["state_mb"]
    assert len(per_device) == devices and max(per_device) <= 1.05 * min(per_device)


@pytest.mark.parametrize("devices,name", CASES, ids=CASE_IDS)
def test_every_parameter_but_the_norm_scales_and_its_moments_are_sharded_over_all_devices(run_on, devices, name):
    assert_spread_over_every_device_of_a_replica(run_on(devices)[name], devices, replicas(name))


# Tensor parallelism on the mesh (fsdp 2, tp 2): device = 2 * fsdp + tp, tp ranks neighbours. A colwise weight
# [out, in] has out over tp and in over fsdp, a rowwise one the reverse; a norm is too small to cut.
TP_LAYOUT = {"self_attn.q_proj.weight": "{devices=[2,2]0,2,1,3}", "self_attn.k_proj.weight": "{devices=[2,2]0,2,1,3}",
             "mlp.up_proj.weight": "{devices=[2,2]0,2,1,3}", "self_attn.o_proj.weight": "{devices=[2,2]0,1,2,3}",
             "mlp.down_proj.weight": "{devices=[2,2]0,1,2,3}", "input_layernorm.weight": "{replicated}"}


def test_tensor_parallel_weights_are_split_over_tp_and_fsdp(run_on):
    shardings = run_on(4)["fsdp2_tp2"]["shardings"]
    for layer in (0, 1):
        for suffix, spec in TP_LAYOUT.items():
            assert shardings[f"model.layers.{layer}.{suffix}"] == spec, suffix


def test_tensor_parallel_activations_are_split_by_feature(run_on):
    """The colwise layers' outputs [rows, positions, features] carry features over tp (rows over fsdp), the
    rowwise layers' outputs are whole over tp; plain fsdp annotates no feature split."""
    split = "{devices=[2,1,2]0,1,2,3}"  # rows over fsdp (devices 0,1 | 2,3), features over tp (0,2 | 1,3)
    annotations = [(tuple(shape), spec) for shape, spec in run_on(4)["fsdp2_tp2"]["annotations"]]
    features = {shape[-1] for shape, spec in annotations if spec == split}
    assert features == {64, 32, 160}  # q_proj; k_proj, v_proj (2 kv heads); gate_proj, up_proj
    assert sum(spec == split for _, spec in annotations) == 2 * 5  # 2 layers x q, k, v, gate, up
    assert not any(spec == split for _, spec in run_on(4)["fsdp4"]["annotations"])


@pytest.mark.parametrize("devices,name", [(2, "base"), (4, "fsdp4"), (4, "fsdp2_cp2_allgather")],
                         ids=["2", "4", "4 cp2"])
def test_inputs_are_sharded_by_row_and_with_cp_by_position(run_on, devices, name):
    cp = int(VARIANTS[name].overrides.get("plan.cp_size", 1))
    assert tile(run_on(devices)[name]["input_sharding"]) == [devices // cp, cp]


def test_eval_loss_is_the_same_with_sequences_split(run_on):
    results = run_on(4)
    assert results["fsdp2_cp2_allgather"]["initial_eval"]["eval_loss"] == pytest.approx(
        results["fsdp4"]["initial_eval"]["eval_loss"], abs=1e-6)


def test_preprocess_logits_for_metrics_gets_whole_rows_with_sequences_split(run_on):
    """Hugging Face Trainer's preprocess_logits_for_metrics, run by predict_step on the gathered xla logits."""
    predictions = run_on(4)["fsdp2_cp2_allgather"]["predictions"]
    assert predictions["shape"] == [8, 64] and predictions["preprocessed_are_argmax"]


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


# The tiny Mixtral (4 experts a layer) with its experts split over 2 of the 4 fsdp devices, or over all 4 devices
# of fsdp 2 x tp 2 (ep ranks taken from fsdp x tp); both run with the 4-device slow variants.
MIXTRAL_PLANS = {"mixtral_fsdp4_ep2": {"plan.ep_size": "2"},
                 "mixtral_fsdp2_tp2_ep4": {"plan.ep_size": "4", "plan.tp_size": "2"}}


def mixtral_overrides(tmp_path_factory, name: str) -> dict:
    return {"model.init_from": str(families.saved(tmp_path_factory, "mixtral")), **MIXTRAL_PLANS[name]}


SLOW_CHUNK = 5  # variants per process: one process for them all would outlast the per-test timeout
SLOW_CHUNKS = [(devices, chunk) for devices, names in SLOW_VARIANTS.items()
               for listed in [[*names, *MIXTRAL_PLANS] if devices == 4 else names]
               for chunk in (listed[i:i + SLOW_CHUNK] for i in range(0, len(listed), SLOW_CHUNK))]


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    """name -> the results of that slow variant; its chunk of SLOW_CHUNKS runs in one process, on first use."""
    cache = {}

    def results(name: str) -> dict:
        if name not in cache:
            devices, chunk = next((devices, chunk) for devices, chunk in SLOW_CHUNKS if name in chunk)
            args = [f"{n}={json.dumps(mixtral_overrides(tmp_path_factory, n))}" if n in MIXTRAL_PLANS else n
                    for n in chunk]
            cache.update(variants(tmp_path_factory.mktemp("slow"), devices, STEPS, args))
        return cache[name]

    return results


SLOW_NAMES = [n for names in SLOW_VARIANTS.values() for n in names]
SEQUENCE_SPLIT = [n for n in SLOW_NAMES if {"plan.cp_size", "plan.sp_size"} & VARIANTS[n].overrides.keys()]
ULYSSES = [n for n in SLOW_NAMES if "plan.sp_size" in VARIANTS[n].overrides]


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_NAMES)
def test_plan_variants_match_reference(slow_results, name):
    deviation = max_relative_difference(slow_results(name)["losses"], reference_for(name))
    if VARIANTS[name].bf16:  # torch_xla's autocast is applied, and close
        assert 1e-6 < deviation <= BF16_RTOL
    else:
        assert deviation <= FP32_RTOL


@pytest.mark.slow
def test_tied_embeddings_stay_tied(slow_results):
    assert slow_results("tied")["tied"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SLOW_NAMES if not VARIANTS[n].bf16])
def test_eval_loss_before_training_is_the_plain_torch_models(slow_results, name):
    """Σ token losses / Σ label tokens counted before any split: the same under cp, sp, tp and HSDP."""
    assert slow_results(name)["initial_eval"]["eval_loss"] == pytest.approx(slow_results(name)["plain_eval"],
                                                                            rel=EVAL_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEQUENCE_SPLIT)
def test_predictions_with_sequences_split_are_whole_and_in_order(slow_results, name):
    predictions = slow_results(name)["predictions"]
    assert predictions["shape"] == [8, 64]  # eval_batch_size rows of seq_len tokens: nothing cut, nothing repeated
    assert predictions["labels_equal"] and predictions["predictions_are_argmax"]
    assert predictions["max_logit_difference"] <= 1e-5  # against the plain-torch model, position by position


@pytest.mark.slow
@pytest.mark.parametrize("name", ULYSSES)
def test_ulysses_attention_is_split_by_head(slow_results, name):
    """q/k/v [rows, heads, positions, dim] and the attention output [rows, positions, heads, dim] carry their
    heads over sp (x tp) and nothing over positions, while the layers' outputs carry positions over sp: XLA
    exchanges them around attention."""
    overrides = VARIANTS[name].overrides
    sp = int(overrides["plan.sp_size"])
    heads = sp * int(overrides.get("plan.tp_size", 1))
    four_d = [(shape, tile(spec)) for shape, spec in slow_results(name)["annotations"] if len(shape) == 4]
    by_head = [(shape, dims) for shape, dims in four_d if dims[1:] in ([heads, 1, 1], [1, heads, 1])]
    assert len(by_head) == len(four_d) == 2 * 4  # 2 layers x q, k, v, output
    assert sorted({tuple(shape[1:]) for shape, _ in by_head}) == [(2, 64, 16), (4, 64, 16), (64, 4, 16)]
    layers = [tile(spec) for shape, spec in slow_results(name)["annotations"] if shape[1:] == [64, 64]]
    assert layers and all(dims[1] == sp for dims in layers)  # between layers: positions over sp


@pytest.mark.slow
def test_hsdp_shards_within_a_replica_and_repeats_over_replicas(slow_results):
    result = slow_results("hsdp2x2")
    assert_spread_over_every_device_of_a_replica(result, 4, 2)
    assert tile(result["input_sharding"]) == [4, 1]  # every device reads its own rows
    sharded = result["sharded"]
    assert [f for f in sharded["files"] if f.startswith("sharded/device_")] == [
        f"sharded/device_{d:05d}.safetensors" for d in range(4)]
    assert sharded["loaded_eval"] == sharded["saved_eval"]
    assert sharded["resumed"] == sharded["continued"]


@pytest.mark.slow
def test_full_checkpoint_saved_with_tensor_parallelism_resumes_with_plain_fsdp(slow_results):
    resume = slow_results("tp2")["full_resume"]
    assert slow_results("tp2")["shardings"]["model.layers.0.self_attn.k_proj.weight"] == "{devices=[2,1]0,1}"
    assert resume["resumed_shardings"]["model.layers.0.self_attn.k_proj.weight"] == "{devices=[1,2]0,1}"
    assert resume["loaded_eval"] == pytest.approx(resume["saved_eval"], rel=EVAL_RTOL)
    assert max_relative_difference(resume["resumed"], resume["reference"]) <= FP32_RTOL


# name -> the shardings of layer weights: [4, 320, 64] gate_up_proj, [4, 64, 160] down_proj, q_proj
MIXTRAL_SHARDINGS = {
    # device = 2 * fsdp + ep: experts over ep, the largest other dimension over the outer fsdp; attention over all
    "mixtral_fsdp4_ep2": ("{devices=[2,2,1]0,2,1,3}", "{devices=[2,1,2]0,2,1,3}", "{devices=[4,1]0,1,2,3}"),
    # device = 2 * fsdp + tp: experts over ep x tp, block d on device d (torch's ep rank); q_proj's rows over tp
    "mixtral_fsdp2_tp2_ep4": ("{devices=[4,1,1]0,1,2,3}", "{devices=[4,1,1]0,1,2,3}", "{devices=[2,2]0,2,1,3}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MIXTRAL_PLANS))
def test_mixtral_experts_are_split_over_ep_and_train_like_one_process(slow_results, tmp_path_factory, name):
    result = slow_results(name)
    shardings = result["shardings"]
    for layer in (0, 1):
        assert (shardings[f"model.layers.{layer}.mlp.experts.gate_up_proj"],
                shardings[f"model.layers.{layer}.mlp.experts.down_proj"],
                shardings[f"model.layers.{layer}.self_attn.q_proj.weight"]) == MIXTRAL_SHARDINGS[name]
    assert result["initial_eval"]["eval_loss"] == pytest.approx(result["plain_eval"], rel=EVAL_RTOL)
    overrides = {k: v for k, v in mixtral_overrides(tmp_path_factory, name).items() if not k.startswith("plan.")}
    assert max_relative_difference(result["losses"], reference_losses(make_config(overrides), STEPS)) <= FP32_RTOL
