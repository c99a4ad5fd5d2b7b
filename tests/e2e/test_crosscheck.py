"""`python -m portable_fsdp.crosscheck`: backends agree on the same weights and batches, and a deliberately
perturbed backend is caught with a non-zero exit."""
import json
import subprocess
import sys

from tests.conftest import ROOT


def crosscheck(tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "portable_fsdp.crosscheck", "--backends", "cpu,flax", "--steps", "5",
                           "--out", str(tmp_path / "cc"), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_backends_agree_and_a_wrong_learning_rate_is_caught(tmp_path):
    agree = crosscheck(tmp_path)
    assert agree.returncode == 0, agree.stderr[-3000:]
    report = json.loads((tmp_path / "cc.json").read_text())
    assert report["agree"] and report["max_rel_diff"] <= 1e-4
    assert [r["step"] for r in report["rows"]] == [1, 2, 3, 4, 5]
    assert (tmp_path / "cc.png").stat().st_size > 10_000
    assert "agree: largest relative difference" in agree.stdout

    perturbed = crosscheck(tmp_path, "--override", "flax:train.lr=0.0031")
    assert perturbed.returncode == 1
    report = json.loads((tmp_path / "cc.json").read_text())
    assert not report["agree"] and report["max_rel_diff"] > 1e-4
    assert "DISAGREE" in perturbed.stdout and "<-- over rtol" in perturbed.stdout


def test_an_unknown_backend_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "portable_fsdp.crosscheck", "--backends", "cpu,tpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --backends: unknown backend 'tpu'; choose from cpu, cuda, xla, flax"
