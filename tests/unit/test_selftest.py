"""The self-test's decisions without running anything: which rows a backend honours where (the capability table,
the devices), how a row is judged against its CPU reference, the measurements against a datasheet (GPUs and TPUs
injected by name), and the table."""
import dataclasses

import pytest

from portable_fsdp.machine import hardware
from portable_fsdp.backend import ModelInfo
from portable_fsdp.selftest import features, probe, report, runs

FEATURES = {f.name: f for f in features.FEATURES}
LLAMA = ModelInfo((), (), n_params=1, n_layers=2, hidden_size=64, vocab_size=384, model_type="llama",
                  num_attention_heads=4, num_key_value_heads=2)
MIXTRAL = dataclasses.replace(LLAMA, model_type="mixtral", num_experts=4)


def reason(name, backend, device="cpu", devices=2, model=None):
    feature = FEATURES[name]
    return features.not_honoured(feature, backend, device, devices, model or (MIXTRAL if feature.model == "moe"
                                                                               else LLAMA))


def test_what_each_backend_runs_follows_the_capability_table():
    assert reason("fsdp", "cpu") == ""
    assert reason("cp_torch_allgather", "cpu").startswith("refused on --backend cpu: plan.cp_impl: torch's context_")
    assert reason("cp_torch_allgather", "cuda", device="cuda") == ""
    assert reason("cp_portable_alltoall", "xla").startswith("plan.cp_impl has no effect on --backend xla")
    assert reason("cp", "xla") == "" and reason("cp", "cpu") == "for --backend xla / flax"
    assert reason("float8", "cpu").startswith("refused on --backend cpu: plan.float8:")
    assert reason("float8", "cuda", device="cuda") == ""
    assert reason("compile", "flax").startswith("plan.compile has no effect on --backend flax")
    assert reason("cpu_offload", "xla").startswith("refused on --backend xla: plan.cpu_offload:")
    assert reason("fsdp_v1", "xla", devices=1) == ""
    assert reason("fsdp_v1", "xla").startswith("refused on --backend xla: --nproc: 2: FSDP v1")
    assert reason("background_save_resume", "xla").startswith("train.async_save has no effect on --backend xla")
    assert reason("ep", "flax") == ""


def test_a_row_needing_more_devices_says_so():
    assert reason("tp", "cuda", device="cuda", devices=1) == "needs 2 devices (1 here)"
    assert reason("hsdp", "cpu", devices=1) == "needs 2 devices (1 here)"


def test_the_global_batch_gives_every_data_parallel_rank_rows():
    assert features.run_settings(2)["train.batch_size"] == 4
    assert features.run_settings(8)["train.batch_size"] == 16
    config = features.model_config("moe", 8, {"plan.ep_size": "2"})
    assert config.model.architecture == "mixtral" and config.train.batch_size == 16 and config.plan.ep_size == 2


def test_the_reference_trains_the_model_and_training_fields_never_the_plan():
    assert features.reference_overrides(FEATURES["bf16_fp32_reduce"]) == {"model.attn_implementation": "eager"}
    assert features.reference_overrides(FEATURES["background_save_resume"]) == {}
    assert features.reference_overrides(FEATURES["export"]) == {}


class Scripted:
    """runs.run's stand-in: the losses each call logs."""

    def __init__(self, *losses, starts=(0,)):
        self.losses, self.starts, self.calls = list(losses), list(starts), []

    def __call__(self, backend, nproc, feature, workdir, weights, overrides, devices, timeout=0):
        self.calls.append((backend, nproc, overrides))
        return runs.Run(workdir, self.losses.pop(0), self.starts, 1000.0, 1.0)


def judge(monkeypatch, tmp_path, name, mine, reference, starts=(0,)):
    monkeypatch.setattr(runs, "run", Scripted(*mine, starts=starts))
    references = runs.References(tmp_path, {"llama": tmp_path / "w", "moe": tmp_path / "w"})
    references.runs[runs.json.dumps(["llama", features.reference_overrides(FEATURES[name])], sort_keys=True)] = \
        runs.Run(tmp_path, reference, [0], 1.0, 1.0)
    return runs.judge(FEATURES[name], "cuda", 2, 2, tmp_path, references)


def test_a_row_passes_within_its_tolerance_of_the_cpu_process_and_fails_past_it(monkeypatch, tmp_path):
    reference = [5.0, 4.0, 3.0]
    close = judge(monkeypatch, tmp_path, "fsdp", [[5.0, 4.0002, 3.0]], reference)
    assert close["passed"] and close["max_rel_diff"] == pytest.approx(5e-5)
    apart = judge(monkeypatch, tmp_path, "fsdp", [[5.0, 4.01, 3.0]], reference)
    assert not apart["passed"] and apart["max_rel_diff"] == pytest.approx(2.5e-3)
    bf16 = judge(monkeypatch, tmp_path, "bf16_fp32_reduce", [[5.0, 4.01, 3.0]], reference)
    assert bf16["passed"]  # 2.5e-3 is within bfloat16's tolerance


def test_a_resumed_row_must_start_again_at_its_checkpoint(monkeypatch, tmp_path):
    losses = [5.0, 4.0, 3.0]
    resumed = judge(monkeypatch, tmp_path, "sharded_resume", [losses, losses], losses, starts=(0, features.STOP))
    assert resumed["passed"] and runs.run.calls[0][2]["train.stop_at_step"] == features.STOP
    assert runs.run.calls[1][2]["train.resume"] is True
    with pytest.raises(runs.RunFailed, match="the second start began at step \\[0\\]"):
        judge(monkeypatch, tmp_path, "sharded_resume", [losses, losses], losses, starts=(0, 0))


MEASURED = {"device_kind": "NVIDIA H100 80GB HBM3", "devices": 8, "bus_bandwidth": 400e9,
            "matmul_flops": {"bfloat16": 750e12, "float32": 50e12}}


def test_measurements_are_set_against_the_datasheet_and_fail_under_its_floor():
    rows = {row["feature"]: row for row in probe.rows(MEASURED)}
    assert rows["matmul_bfloat16"]["passed"] and "76% of 989 (datasheet)" in rows["matmul_bfloat16"]["figure"]
    assert rows["all_reduce"]["passed"] and "89% of NVLink 4" in rows["all_reduce"]["figure"]
    slow = probe.rows({**MEASURED, "bus_bandwidth": 50e9, "matmul_flops": {"bfloat16": 300e12, "float32": 50e12}})
    slow = {row["feature"]: row for row in slow}
    assert not slow["matmul_bfloat16"]["passed"] and not slow["all_reduce"]["passed"]  # under half, a quarter
    assert slow["matmul_float32"]["passed"]  # 50 of 67 TFLOP/s
    cpu = {row["feature"]: row for row in probe.rows({**MEASURED, "device_kind": "cpu", "devices": 1})}
    assert all(row["passed"] for row in cpu.values())  # no datasheet, no floor
    assert cpu["all_reduce"]["figure"] == "one device: nothing to exchange"
    tpu = {row["feature"]: row for row in probe.rows({**MEASURED, "device_kind": "TPU v5p-8", "bus_bandwidth": 1e9})}
    assert tpu["all_reduce"]["passed"]  # a torus's share of its links depends on the slice: no floor


def test_bus_bandwidth_is_what_each_device_sends_and_receives():
    assert hardware.bus_bandwidth(2**30, 1.0, 8) == pytest.approx(2 * 7 / 8 * 2**30)
    assert hardware.bus_bandwidth(2**30, 1.0, 1) == 0.0
    times = iter([9.0, 9.0, 2.0, 1.0, 3.0, 1.5, 4.0])  # two warm-ups, then the best of five
    size = hardware.ALL_REDUCE_BYTES["accelerator"]
    assert hardware.measured_bus_bandwidth(lambda n: next(times), "NVIDIA H200", 2) == pytest.approx(size)


def test_the_table_names_failed_rows_and_why_others_were_skipped():
    rows = [{"feature": "fsdp", "passed": True, "max_rel_diff": 1e-7, "seconds": 12.0, "figure": "9 tokens/s"},
            {"feature": "tp", "passed": False, "error": "error: boom", "seconds": 3.0},
            {"feature": "float8", "skipped": "refused"}]
    lines = report.table(rows).splitlines()
    assert lines[1].split()[:4] == ["fsdp", "pass", "1.0e-07", "12"] and lines[1].endswith("9 tokens/s")
    assert lines[2].split()[:2] == ["tp", "FAIL"] and lines[2].endswith("error: boom")
    assert lines[3].split()[:2] == ["float8", "skipped"] and lines[3].endswith("refused")
    assert report.failed(rows) == ["tp"]
