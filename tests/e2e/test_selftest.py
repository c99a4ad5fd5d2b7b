"""`python -m portable_fsdp.selftest` as a user runs it, on each backend this machine has: the CPU (gloo ranks), torch_xla
on PJRT CPU devices and JAX host devices. The default suite runs a few rows of each; `slow` runs every row. A row
whose run fails (a loss poisoned on one rank) fails the self-test, which names it."""
import json
import os
import subprocess
import sys

import pytest

from portable_fsdp.selftest import features
from tests.conftest import ROOT


def selftest(tmp_path, *args, env=None, timeout=3000):
    proc = subprocess.run([sys.executable, "-m", "portable_fsdp.selftest", "--workdir", str(tmp_path), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    report = json.loads((tmp_path / "selftest.json").read_text()) if (tmp_path / "selftest.json").exists() else None
    return proc, report


def rows_of(report) -> dict:
    return {row["feature"]: row for row in report["rows"]}


# Per backend: a selection of rows — the measurements, training compared with the CPU process, a checkpoint resumed
# and an export; the default suite runs cpu's (the other backends train and resume in their own tests), `slow` the
# other selections and every row on every backend.
DEFAULT = {"cpu": "devices,export", "xla": "ep", "flax": "background_save_resume"}


@pytest.mark.parametrize("backend", [b if b == "cpu" else pytest.param(b, marks=pytest.mark.slow) for b in DEFAULT])
def test_a_selection_of_rows_passes_on_every_backend(tmp_path, backend):
    proc, report = selftest(tmp_path, "--backend", backend, "--only", DEFAULT[backend])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = rows_of(report)
    chosen = DEFAULT[backend].split(",")
    expected = {"matmul_bfloat16", "matmul_float32", "all_reduce"} if "devices" in chosen else set()
    assert set(rows) == expected | {name for name in chosen if name != "devices"}
    for name, row in rows.items():
        assert row["passed"] and not row.get("skipped"), row
        if "max_rel_diff" in row:  # a training row: every step within its tolerance of the CPU process
            assert len(row["losses"]) == features.STEPS and row["max_rel_diff"] <= row["rtol"]
    assert report["passed"] and report["backend"] == backend and report["devices"] == 2
    table = proc.stdout.splitlines()
    assert table[0].split()[:5] == ["feature", "result", "max", "rel", "diff"]
    assert proc.stdout.strip().splitlines()[-1].startswith("selftest passed: ")


@pytest.mark.slow
@pytest.mark.timeout(3000)  # every row of a backend: ~8 min alone on 2 cores, more beside another test
@pytest.mark.parametrize("backend", ["cpu", "xla", "flax"])
def test_every_row_this_backend_honours_passes(tmp_path, backend):
    proc, report = selftest(tmp_path, "--backend", backend)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    rows = rows_of(report)
    ran = [name for name, row in rows.items() if not row.get("skipped")]
    assert all(rows[name]["passed"] for name in ran)
    assert {"fsdp", "tp", "sp", "ep", "hsdp", "sharded_resume", "full_resume", "export"} <= set(ran), rows
    if backend == "cpu":  # what this backend refuses here is skipped with the table's reason, never run
        assert rows["cp_torch_allgather"]["skipped"].startswith("refused on --backend cpu: plan.cp_impl")
        assert rows["float8"]["skipped"].startswith("refused on --backend cpu: plan.float8:")


def test_a_failing_row_fails_the_selftest_naming_it(tmp_path):
    # rank 1's loss poisoned at step 2: the row's run stops (train.nonfinite=stop); the CPU reference, one
    # process, is untouched
    proc, report = selftest(tmp_path, "--backend", "cpu", "--only", "fsdp",
                            env={"PORTABLE_FSDP_FAULTS": "nan@step:rank=1:step=2"})
    assert proc.returncode == 1
    row = rows_of(report)["fsdp"]
    assert not row["passed"] and row["error"].startswith("error: ")
    assert proc.stdout.strip().splitlines()[-1].startswith("selftest FAILED: 1 of 1 rows: fsdp; wrote ")
    assert not report["passed"]


def test_a_row_this_machine_cannot_run_is_skipped_with_the_reason(tmp_path):
    proc, report = selftest(tmp_path, "--backend", "cpu", "--nproc", "1", "--only", "tp,cp_torch_allgather")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = rows_of(report)
    assert rows["tp"]["skipped"] == "needs 2 devices (1 here)"
    assert rows["cp_torch_allgather"]["skipped"].startswith("needs 2 devices")
    assert "skipped" in proc.stdout and "(2 not honoured here)" in proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args, line", [
    (["--only", "fsdp,warp_drive"], "error: --only: unknown row 'warp_drive'; choose from devices, fsdp, "),
    (["--nproc", "0"], "error: --nproc: must be at least 1 (got 0)"),
    (["--backend", "cuda"], "error: --backend: cuda was asked for but no GPU is visible; use --backend cpu"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, line):
    proc, report = selftest(tmp_path, *args, timeout=300)
    assert proc.returncode == 2 and report is None
    assert proc.stderr.strip().splitlines()[-1].startswith(line)


def test_the_readme_says_to_run_it_before_a_first_long_run():
    readme = (ROOT / "README.md").read_text()
    assert "python -m portable_fsdp.selftest" in readme
