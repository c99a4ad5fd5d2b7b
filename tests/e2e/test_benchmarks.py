"""The benchmark scripts still run (slow: they start several multi-process runs). They measure nothing
here: tiny models, a few steps."""
import json

import pytest

from benchmarks.common import TINY_MODEL, run_python
from benchmarks.hf_trainer import run_hf_trainer
from benchmarks.run import QUICK_RESULTS


@pytest.mark.slow
def test_hf_trainer_really_trains_with_fsdp2_on_cpu():
    # the worker raises unless Trainer's model ends up an FSDP2 module with DTensor parameters
    result = run_hf_trainer(TINY_MODEL, seq_len=64, global_batch=4, steps=3)
    assert len(result["step_seconds"]) == 3 and result["tokens_per_sec"] > 0 and result["final_loss"] > 0
    assert len(result["losses"]) == 3 and result["losses"][-1] == result["final_loss"]


@pytest.mark.slow
def test_peers_quick_runs_ours_against_trainer_and_skips_the_peers_not_installed(tmp_path):
    out = tmp_path / "portable_fsdp_peers_quick.json"
    proc = run_python(["-m", "benchmarks.peers", "--quick"], timeout=900,
                      env={"PORTABLE_FSDP_TORCHTITAN_PYTHON": "", "PORTABLE_FSDP_MAXTEXT_PYTHON": "",
                           "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchtitan skipped" in proc.stdout and "MaxText skipped" in proc.stdout
    [row] = json.loads(out.read_text())["rows"]
    assert row["pair"] == "ours / HF Trainer, 2 ranks" and row["ratio"] > 0
    assert len(row["ours"]["losses"]) == len(row["peer"]["losses"]) == 6


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_quick_suite_writes_every_section():
    QUICK_RESULTS.with_suffix(".json").unlink(missing_ok=True)  # what is read below is this run's
    proc = run_python(["-m", "benchmarks.run", "--quick"], timeout=1200)  # kills its workers on a timeout
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(QUICK_RESULTS.with_suffix(".json").read_text())
    assert {"throughput", "memory", "scaling", "communication", "overhead", "machine"} <= set(results)
    for row in results["communication"]["rows"]:
        sent = row["sent_per_step"]
        assert sent["all_gather"] + sent["reduce_scatter"] == pytest.approx(row["expected_bytes"], rel=1e-3)


@pytest.mark.slow
def test_object_storage_benchmark_sets_each_save_and_resume_against_the_raw_transfer():
    proc = run_python(["-m", "benchmarks.object_storage", "--quick"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| FULL", "| SHARDED"))]
    assert len(rows) == 2


@pytest.mark.slow
def test_moe_benchmark_sets_ours_against_trainer_and_counts_executed_flops():
    proc = run_python(["-m", "benchmarks.moe", "--quick"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| smoke"))
    # every expert executes exactly what its routed rows need, with and without expert parallelism
    assert "1.000 / 1.000" in [cell.strip() for cell in row.split("|")]


@pytest.mark.parametrize("only, message", [("speed", "unknown section(s) ['speed']"), (",", "no section given")])
def test_a_bad_section_list_is_a_one_line_error(only, message):
    proc = run_python(["-m", "benchmarks.run", "--only", only], timeout=60)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1]


def test_a_bad_comm_worker_mode_is_a_one_line_error(tmp_path):
    proc = run_python(["-m", "benchmarks.comm_worker", str(tmp_path / "out.json"), "bytes"], timeout=60)
    assert proc.returncode == 1 and "mode 'bytes': use steps" in proc.stderr.strip().splitlines()[-1]


def test_benchmarks_take_the_run_commands_config_overrides(monkeypatch):
    """`--config.a.b=value` on a benchmark's command line is checked as `run` checks it and reaches every run it
    makes, its worker subprocesses included (through the environment)."""
    import argparse

    from benchmarks import common

    monkeypatch.delenv(common.OVERRIDES_ENV, raising=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = common.parse_benchmark_args(parser, ["--steps", "3", "--config.model.hidden_size=96",
                                                "--config.train.lr=0.01"])
    assert args.steps == 3
    config = common.config_from_flags(["--config.train.lr=0.02"])  # the command line wins, as it comes last
    assert config.model.hidden_size == 96 and config.train.lr == 0.01
    with pytest.raises(SystemExit, match="error: config.train.stepz: unknown field; did you mean config.train.steps?"):
        common.parse_benchmark_args(parser, ["--config.train.stepz=3"])


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_quick_mesh_table_counts_bytes_as_its_formulas():
    import tempfile
    import pathlib

    out = pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_mesh_quick.json"
    out.unlink(missing_ok=True)
    proc = run_python(["-m", "benchmarks.mesh", "--quick"], timeout=2300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    from benchmarks.mesh import SETTINGS

    assert {s.name for s in SETTINGS} == {r["setting"] for r in rows}
    for row in rows:
        sent, expected = row["sent_per_step"], row["expected_per_step"]
        # FSDP's collectives are counted exactly (context parallelism all-gathers keys and values on top)
        for kind in ("all_gather", "reduce_scatter"):
            if row["setting"].startswith("cp"):
                assert sent.get(kind, 0) >= expected[kind], (row["setting"], kind)
            else:
                assert sent.get(kind, 0) == pytest.approx(expected[kind], rel=1e-3), (row["setting"], kind)
        if row["setting"] in ("hsdp 2x2", "fsdp2 x tp2", "tp4"):  # HSDP's replicas, TP's activations
            assert sent["all_reduce"] == pytest.approx(expected["all_reduce"], rel=0.01), row["setting"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gpu_benchmark_dry_run_trains_each_setting_next_to_hf_trainer():
    """benchmarks/gpu.py on CPU with the smoke model: eager and compiled rows and Trainer's measured, the float8
    rows refused with --backend cpu's one line, the context-parallel and mesh sections still there."""
    import pathlib
    import tempfile

    out = pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_gpu_dry_run.json"
    out.unlink(missing_ok=True)
    proc = run_python(["-m", "benchmarks.gpu", "--dry-run-cpu"], timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = {row["setting"]: row for row in results["training"]}
    assert list(rows) == ["eager", "compile", "compile + float8", "HF Trainer"]
    for name in ("eager", "compile", "HF Trainer"):
        row = rows[name]
        assert "error" not in row, row
        assert row["tokens_per_sec"] > 0 and 0 < row["mfu"] < 1 and row["peak_mem_mb"] > 0, row
    assert rows["compile + float8"]["error"].startswith("error: plan.float8: float8 matmuls need an NVIDIA GPU")
    assert {r["mode"] for r in results["context_parallel"]["results"]} == {"ranks", "one-rank"}
    assert len(results["mesh"]) >= 2
    assert "| HF Trainer" in proc.stdout and "vs HF Trainer" in proc.stdout
