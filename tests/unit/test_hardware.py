"""The rules the core owns for every backend: MFU's peak (portable_fsdp.machine.hardware), its FLOPs without the
embedding table, and when a resume restores the saved RNG."""
import warnings

import pytest

from portable_fsdp.checkpoint import layout as checkpointing

from portable_fsdp.machine import hardware

from portable_fsdp.training import metrics
from portable_fsdp.backend import ModelInfo

T = 1e12


class Timer:
    """A time_matmul primitive for a device reaching `rate` FLOP/s; records the products it was asked for."""

    def __init__(self, rate=1e9):
        self.rate, self.calls = rate, []

    def __call__(self, size, dtype):
        self.calls.append((size, dtype))
        return 2.0 * size**3 / self.rate


@pytest.mark.parametrize("kind, dtype, expected", [
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312 * T),
    ("NVIDIA A100 80GB PCIe", "float32", 19.5 * T),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989 * T),
    ("NVIDIA H100 PCIe", "bfloat16", 756 * T),
    ("NVIDIA H100 NVL", "float32", 60 * T),
    ("NVIDIA H200", "bfloat16", 989 * T),
    ("NVIDIA H200", "float32", 67 * T),
    ("NVIDIA H200 NVL", "bfloat16", 835 * T),
    ("NVIDIA B200", "bfloat16", 2250 * T),
    ("NVIDIA L4", "bfloat16", 121 * T),
    ("NVIDIA A10G", "bfloat16", 70 * T),
    ("NVIDIA A10", "float32", 31.2 * T),
    ("TPU v4", "bfloat16", 275 * T),
    ("TPU v5 lite", "bfloat16", 197 * T),
    ("TPU v5", "bfloat16", 459 * T),
    ("TPU v5p", "bfloat16", 459 * T),
    ("TPU v6 lite", "bfloat16", 918 * T),
])
def test_the_datasheet_matches_the_names_frameworks_report(kind, dtype, expected):
    timer = Timer()
    assert hardware.peak_flops_per_device(0.0, kind, dtype, timer) == expected
    assert timer.calls == []  # nothing measured


def test_the_dtype_column_is_the_compute_dtype():
    assert hardware.datasheet_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989 * T
    assert hardware.datasheet_flops("NVIDIA H100 80GB HBM3", "float16") == 989 * T
    assert hardware.datasheet_flops("NVIDIA H100 80GB HBM3", "float32") == 67 * T
    assert hardware.datasheet_flops("TPU v4", "float32") is None  # TPUs publish no fp32 rate


def test_similar_names_do_not_match_each_other():
    assert hardware.datasheet_entry("NVIDIA A100-SXM4-40GB")[0] == "A100"
    assert hardware.datasheet_entry("NVIDIA A10G")[0] == "A10G"
    assert hardware.datasheet_entry("NVIDIA L40S") is None
    assert hardware.datasheet_entry("NVIDIA GH200 480GB") is None


def test_a_configured_peak_wins_over_the_datasheet_and_the_measurement():
    timer = Timer()
    assert hardware.peak_flops_per_device(5e14, "NVIDIA H100 80GB HBM3", "bfloat16", timer) == 5e14
    assert hardware.peak_flops_per_device(5e9, "cpu", "float32", timer) == 5e9
    assert timer.calls == []


def test_cpu_is_measured_without_a_warning_the_same_way_everywhere():
    timer = Timer(rate=3e10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware.peak_flops_per_device(0.0, "cpu", "bfloat16", timer) == pytest.approx(3e10)
    size = hardware.MEASURE_SIZE["cpu"]
    assert timer.calls == [(size, "bfloat16")] * (hardware.WARMUP + hardware.REPEATS)


def test_the_measurement_keeps_the_best_timed_run_after_the_warm_up():
    times = iter([100.0] * hardware.WARMUP + [4.0, 2.0, 3.0] + [5.0] * (hardware.REPEATS - 3))
    size = hardware.MEASURE_SIZE["cpu"]
    assert hardware.measured_flops(lambda s, d: next(times), "cpu", "float32") == pytest.approx(2 * size**3 / 2.0)


def test_an_unknown_accelerator_is_measured_with_a_warning_naming_the_setting():
    timer = Timer(rate=1e13)
    with pytest.warns(UserWarning, match="train.peak_flops_per_device") as caught:
        assert hardware.peak_flops_per_device(0.0, "NVIDIA RTX 9999", "bfloat16", timer) == pytest.approx(1e13)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert timer.calls[0] == (hardware.MEASURE_SIZE["accelerator"], "bfloat16")
    with pytest.warns(UserWarning, match="train.peak_flops_per_device"):  # a known TPU in a dtype it lacks
        hardware.peak_flops_per_device(0.0, "TPU v4", "float32", Timer())


# ---------------------------------------------------------------- MFU's FLOPs

def test_flops_per_token_leaves_the_embedding_table_out_for_the_tiny_llama():
    # llama_tiny:test: V=384, d=64, ffn=160, L=2, 4 heads of 16, 2 KV heads, untied, T=64
    V, d, ffn, L, kv, T_ = 384, 64, 160, 2, 2 * 16, 64
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * ffn + 2 * d  # q, k, v, o, gate/up/down, two norms
    matmuls = L * per_layer + d + V * d  # + final norm + lm_head
    n_params = matmuls + V * d  # + the input embedding table
    assert n_params == 135_488
    expected = 6 * matmuls + 12 * L * d * T_
    info = ModelInfo((), (), n_params=n_params, n_layers=L, hidden_size=d, vocab_size=V, n_embedding_params=V * d)
    assert metrics.flops_per_token(info, T_) == expected


# ---------------------------------------------------------------- RNG on resume

@pytest.mark.parametrize("manifest, backend, world, restores", [
    ({"backend": "cpu", "world_size": 2}, "cpu", 2, True),
    ({"backend": "cpu", "world_size": 2}, "cpu", 4, False),  # resharded: rank r's stream is not rank r's
    ({"backend": "xla", "world_size": 2}, "cpu", 2, False),  # another backend's generators
    ({"backend": "cpu", "world_size": 2}, "cuda", 2, False),
    ({"world_size": 2}, "xla", 2, False),  # a manifest that does not say
])
def test_rng_is_restored_only_into_the_same_backend_at_the_same_world_size(manifest, backend, world, restores):
    assert checkpointing.restores_rng(manifest, backend, world) is restores


def test_a_fresh_resume_seed_is_distinct_per_rank_and_step():
    seeds = {checkpointing.resume_seed(0, step, rank) for step in (10, 20) for rank in range(4)}
    assert len(seeds) == 8
