"""A module that is not a transformers model trains alike on every backend through the Python API: the example
MLP language model (examples/custom_model) with a custom loss, optimizer and schedule, on cpu (torch FSDP2, one
rank), xla (SPMD over 2 PJRT CPU devices) and flax (its nnx twin over 2 JAX host devices), from the same weights on
the same batches."""
import json
import os
import subprocess
import sys

import pytest

from tests.parity.reference import max_relative_difference

SCRIPT = os.path.join(os.path.dirname(__file__), "custom_module_run.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
STEPS = 6
FP32_RTOL = 1e-5  # the parity bar of the fp32 backends (tests/parity/reference.py)
ENVIRONMENT = {"PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom")
    results = {}
    for backend in ("cpu", "xla", "flax"):
        out = tmp / f"{backend}.json"
        proc = subprocess.run([sys.executable, SCRIPT, backend, str(out), str(STEPS)], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**os.environ, **ENVIRONMENT})
        assert proc.returncode == 0, f"{backend}: {proc.stderr[-4000:]}"
        results[backend] = json.loads(out.read_text())
    return results


def test_the_schedule_sets_the_learning_rate_on_every_backend(runs):
    expected = [0.05 * min(1.0, (step + 1) / 3) for step in range(STEPS)]
    for backend, result in runs.items():
        assert result["lr"] == pytest.approx(expected, rel=1e-6), backend


@pytest.mark.parametrize("backend", ["xla", "flax"])
def test_losses_match_the_torch_backend(runs, backend):
    reference = runs["cpu"]["losses"]
    assert reference[-1] < reference[0]  # it trains
    assert max_relative_difference(runs[backend]["losses"], reference) <= FP32_RTOL
    assert runs[backend]["eval_loss"] == pytest.approx(runs["cpu"]["eval_loss"], rel=FP32_RTOL)
