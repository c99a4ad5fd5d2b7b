"""`python -m portable_fsdp.estimate` and train.check_fit as a user meets them: the traced numbers of a tiny Llama
at 1, 2 and 4 ranks, a model too large for its device (exit 1, one line naming settings that fit), bad input
(one `error:` line, exit 2), and a run refused at start-up before anything is written."""
import os
import subprocess
import sys

import pytest

from portable_fsdp import estimate
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.errors import UserError
from tests.conftest import ROOT, TEST_RECIPE

FLOAT32 = 4
# Two decoder layers of a wide Llama with a 256k vocabulary: 2.5 B parameters, traced as fast as a tiny one.
WIDE = {"model.vocab_size": "256000", "model.hidden_size": "4096", "model.intermediate_size": "11008",
        "model.num_hidden_layers": "2", "model.num_attention_heads": "32", "model.num_key_value_heads": "8",
        "data.seq_len": "256"}


def run_estimate(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "portable_fsdp.estimate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def overridden(recipe, overrides):
    config = load_recipe(recipe)
    for key, value in overrides.items():
        apply_override(config, key, value)
    return config


def test_tiny_llama_per_rank_numbers_at_world_1_2_4():
    config = load_recipe(TEST_RECIPE)  # batch 4 x 64 tokens; every dimension divides by 4: no padding
    with estimate.Estimator() as estimator:
        reports = {n: estimate.estimate_config(config, estimate.resolve_target("cpu", "cpu", n),
                                               [0, 1] if n == 2 else [0], estimator) for n in (1, 2, 4)}
        xla = estimate.estimate_config(config, estimate.resolve_target("xla", "cpu", 2), [0], estimator)
    n_params = reports[1].result["model"]["n_params"]
    assert n_params == 135_488
    for n, report in reports.items():
        rank = report.result["ranks"][0]
        # every parameter's float32 shard (+ the rotary inv_freq buffers, 64 bytes, whole on every rank)
        assert rank["held"]["parameters"] - n_params * FLOAT32 // n in range(0, 129)
        assert rank["held"]["gradients"] == n_params * FLOAT32 // n
        assert rank["held"]["optimizer"] - 2 * n_params * FLOAT32 // n in range(0, 128)  # + AdamW's step counters
        assert rank["micro_batch_rows"] == 4 // n
    rank0, rank1 = reports[2].result["ranks"]
    assert {**rank0, "rank": 1, "seconds": 0} == {**rank1, "seconds": 0}  # the two ranks hold the same
    # the most activations held during the step, per rank: rows per rank 4, 2, 1
    activations = [reports[n].result["ranks"][0]["largest"]["activations"] for n in (1, 2, 4)]
    assert activations[0] > 1.8 * activations[1] and activations[1] > 1.8 * activations[2]
    assert reports[1].peak > reports[2].peak > reports[4].peak
    # xla: the same shards (float32, SPMD partition specs) but the 5 norm scales [64], too small to split
    # (portable_fsdp/placement.py), whole on each device; activations traced from the same model
    device = xla.result["ranks"][0]
    norms = 5 * 64
    assert device["held"]["parameters"] == device["held"]["gradients"] == (n_params - norms) * FLOAT32 // 2 \
        + norms * FLOAT32
    assert device["at_peak"]["activations"] == rank0["at_peak"]["activations"]


def test_a_cuda_estimate_traces_the_choices_a_cuda_run_makes():
    """Traced on fake CPU tensors, a cuda estimate still lowers as a cuda run does: the layers prefetch each
    other's all-gathers (two layers' parameters gathered at once) and attention is sdpa's own call, not the CPU's
    query blocks (more held at the peak)."""
    config = load_recipe(TEST_RECIPE)
    with estimate.Estimator() as estimator:
        cpu, cuda = (estimate.estimate_config(config, estimate.resolve_target(backend, device, 2), [0], estimator)
                     .result["ranks"][0] for backend, device in (("cpu", "cpu"), ("cuda", "h100")))
    assert cuda["largest"]["gathered"] > cpu["largest"]["gathered"]
    assert cuda["at_peak"]["activations"] > cpu["at_peak"]["activations"]


def test_a_model_too_large_for_its_device_exits_1_naming_settings_that_fit():
    words = [f"--config.{k}={v}" for k, v in WIDE.items()]
    proc = run_estimate("--config", TEST_RECIPE, "--device", "a100-40", "--nproc", "1", *words)
    assert proc.returncode == 1, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("does not fit: peak ") and "exceeds 36.00 GiB usable per rank" in last
    # sharding over two ranks halves the 36.7 GiB of float32 weights, gradients and AdamW state; offloading moves
    # them to the host; activation checkpointing and smaller micro-batches leave them as they are (not traced)
    assert "settings that fit: --nproc 2 (peak " in last and "--config.plan.cpu_offload=true (peak " in last
    assert "activation_checkpointing" not in last and "grad_accum_steps" not in last
    assert "rank 0" in proc.stdout and "optimizer state" in proc.stdout and proc.stderr == ""


@pytest.mark.parametrize("args, field", [
    (["--config", "portable_fsdp/configs/llama_tiny.py:nope"], "--config"),
    (["--config", TEST_RECIPE, "--device", "h1000"], "--device"),
    (["--config", TEST_RECIPE, "--config.train.batch_size=3", "--nproc", "2"], "train.batch_size"),
])
def test_bad_input_is_one_error_line_and_exit_2(args, field):
    proc = run_estimate(*args, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {field}: "), proc.stderr


def test_check_fit_refuses_a_run_that_cannot_fit_before_anything_is_written(tmp_path):
    from portable_fsdp.launch import launcher as launch

    config = overridden(TEST_RECIPE, {**WIDE, "train.check_fit": "true"})  # 36.7 GiB of state on a smaller host
    workdir = tmp_path / "run"
    with pytest.raises(UserError) as err:
        launch.start(config, "cpu", workdir, 2)
    assert err.value.field == "train.check_fit" and err.value.message.startswith("does not fit: peak ")
    assert "none of the settings tried fits" in err.value.message  # ranks of one host share its memory
    assert not workdir.exists()


@pytest.mark.slow
def test_llama3_8b_recipe_on_8_h100_fits():
    proc = run_estimate("--config", "portable_fsdp/configs/llama3_8b.py:8xh100", "--device", "h100", "--nproc", "8")
    assert proc.returncode == 0, proc.stderr
    assert "8,030,261,248 parameters" in proc.stdout and "ranks 0, 7" in proc.stdout
    rows = {line[:24].strip(): line[24:].split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert rows["parameters"][:2] == ["3.74", "3.74"]  # 8.03 B float32 / 8 ranks, in GiB
    assert rows["optimizer state"][0] == "7.48"
    assert 25 < float(rows["peak"][0]) < 60
    assert proc.stdout.strip().splitlines()[-1].startswith("fits: peak ")


@pytest.mark.slow
def test_flax_compiled_estimate_shards_state_over_devices():
    config = load_recipe(TEST_RECIPE)
    with estimate.Estimator() as estimator:
        one, two = (estimate.estimate_config(config, estimate.resolve_target("flax", "cpu", n), None, estimator)
                    for n in (1, 2))
    n_params = one.result["model"]["n_params"]
    for n, report in ((1, one), (2, two)):
        device = report.result["ranks"][0]
        # norm scales (under 1024 elements) stay whole on every device
        assert device["held"]["parameters"] - n_params * FLOAT32 // n in range(0, 5 * 64 * FLOAT32 + 1)
        assert device["program"]["temporaries"] > device["held"]["gradients"]  # gradients and activations
    assert one.peak > 1.8 * two.peak


@pytest.mark.parametrize("args", [
    ["--nproc", "2"],
    # bfloat16 on an H100: the grouped GEMM the CUDA run takes, traced in its dtype
    ["--nproc", "2", "--backend", "cuda", "--device", "h100", "--config.plan.param_dtype=bfloat16"],
    # the experts split over 2 ranks: their local kernel (backends/torch/local_experts.py), in float32 one product
    # per expert (torch's fake grouped GEMM is bfloat16 only), in bfloat16 the grouped GEMM
    ["--nproc", "2", "--config.plan.ep_size=2"],
    ["--nproc", "2", "--backend", "cuda", "--device", "h100", "--config.plan.param_dtype=bfloat16",
     "--config.plan.ep_size=2"]])
def test_a_mixture_of_experts_estimate_traces_its_grouped_experts(args):
    proc = run_estimate("--config", f"{ROOT / 'portable_fsdp' / 'configs' / 'qwen3_30b_a3b.py'}:smoke", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the step's FLOPs count the 2 of 4 experts a token runs through (tests/e2e/test_moe_flops.py)
    assert "N = 74,624 active parameters" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("fits: ")
