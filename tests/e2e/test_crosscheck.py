"""`python -m portable_fsdp.crosscheck`: backends agree on the same weights and batches, and a deliberately
perturbed backend is caught with a non-zero exit."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TEST_RECIPE


def crosscheck(cwd, *extra):
    return subprocess.run([sys.executable, "-m", "portable_fsdp.crosscheck", "--backends", "cpu,flax", "--steps", "5",
                           "--config", TEST_RECIPE, *extra], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two backends' runs; that they agree is tested by default in tests/flax/test_parity.py
def test_backends_agree(tmp_path):
    # --config.* overrides as `run` takes them; no --workdir: runs/crosscheck-<time>, nothing in the cwd itself
    agree = crosscheck(tmp_path, "--config.train.weight_decay=0.05")
    assert agree.returncode == 0, agree.stderr[-3000:]
    (workdir,) = (tmp_path / "runs").iterdir()
    assert workdir.name.startswith("crosscheck-") and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    report = json.loads((workdir / "crosscheck.json").read_text())
    assert report["agree"] and report["max_rel_diff"] <= 1e-4
    assert report["overrides"] == ["config.train.weight_decay=0.05"]
    assert "agree: largest relative difference" in agree.stdout


@pytest.mark.slow  # two backends' runs (1-3 min on 2 cores); crosscheck's argument checks stay in the default suite
def test_a_wrong_learning_rate_is_caught(tmp_path):
    perturbed = crosscheck(ROOT, "--workdir", str(tmp_path / "cc"), "--override", "flax:train.lr=0.0031")
    assert perturbed.returncode == 1
    report = json.loads((tmp_path / "cc" / "crosscheck.json").read_text())
    assert not report["agree"] and report["max_rel_diff"] > 1e-4
    assert [r["step"] for r in report["rows"]] == [1, 2, 3, 4, 5]
    assert (tmp_path / "cc" / "crosscheck.png").stat().st_size > 10_000
    assert "DISAGREE" in perturbed.stdout and "<-- over rtol" in perturbed.stdout


def test_an_unknown_backend_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "portable_fsdp.crosscheck", "--backends", "cpu,tpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --backends: unknown backend 'tpu'; choose from cpu, cuda, xla, flax"


def test_config_fields_are_checked_as_run_checks_them(tmp_path):
    proc = crosscheck(tmp_path, "--config.train.stepz=3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config.train.stepz: unknown field; did you mean config.train.steps?"
    proc = crosscheck(tmp_path, "--set", "train.steps=3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: command line: unrecognised argument '--set'; fields are set as "
                                   "--config.a.b=value")


def test_the_fields_crosscheck_sets_itself_are_refused_by_name(tmp_path):
    proc = crosscheck(tmp_path, "--config.train.steps=3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config.train.steps: is set by crosscheck; use --steps"
    proc = crosscheck(tmp_path, "--override", "flax:train.log_every=5")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config.train.log_every: is set by crosscheck (every step)"
    assert not (tmp_path / "runs").exists()
