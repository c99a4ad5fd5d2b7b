"""The same commands on a Cloud TPU VM (marked `tpu`: CI has none and skips them).

Run on a TPU VM (torch_xla with libtpu installed; see docs/xla.md):
    PJRT_DEVICE=TPU python -m pytest -m tpu tests/xla/test_tpu.py
"""
import os

import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

pytestmark = pytest.mark.tpu
TPU_ENV = {"PJRT_DEVICE": "TPU", "TF_CPP_MIN_LOG_LEVEL": "2"}
# float32 plans multiply at full precision on a TPU (the lowering sets torch_xla's "highest"; by default fp32
# operands go through one bf16 pass); the compiler's orders of summation still differ from the CPU's.
TPU_RTOL = 1e-2
# A global batch every usual slice (4 or 8 devices per VM) divides.
BATCH = ["--config.train.batch_size=16", "--config.train.eval_batch_size=16"]


# Decided without importing torch_xla here: importing it settles PJRT_DEVICE for every later subprocess.
needs_tpu = pytest.mark.skipif(os.environ.get("PJRT_DEVICE") != "TPU", reason="needs a Cloud TPU VM with PJRT_DEVICE=TPU")


def losses(workdir):
    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


@needs_tpu
@pytest.mark.parametrize("plan", [[], ["--config.plan.activation_checkpointing=true"],
                                  ["--config.plan.xla_fsdp_v2=false"]], ids=["fsdpv2", "fsdpv2-ckpt", "fsdp-v1"])
def test_tpu_run_matches_the_cpu_reference(tmp_path, plan):
    proc = cli(["--backend", "xla", "--config", TEST_RECIPE, "--workdir", str(tmp_path / "run"),
                "--config.train.log_every=1", *BATCH, *plan], cwd=tmp_path, env=TPU_ENV, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = reference_losses(make_config({"train.batch_size": "16"}), 20)
    assert max_relative_difference(losses(tmp_path / "run"), reference) <= TPU_RTOL
    assert (tmp_path / "run" / "checkpoints" / "step_00000020" / "model.safetensors").exists()


@needs_tpu
def test_tpu_metrics_name_the_chip_and_report_its_hbm(tmp_path):
    """Under SPMD the chip is read from the accelerator type (xm.xla_device_kind() raises on the virtual
    device), and memory is the chips' HBM, not the host's."""
    proc = cli(["--backend", "xla", "--config", TEST_RECIPE, "--workdir", str(tmp_path / "run"),
                "--config.train.steps=4", "--config.train.log_every=1", *BATCH], cwd=tmp_path, env=TPU_ENV,
               timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no datasheet peak" not in proc.stderr  # MFU against the chip's datasheet
    step = [r for r in read_metrics(tmp_path / "run") if "loss" in r][-1]
    assert 0 < step["mfu"] < 1 and all(mem > 0 for mem in step["mem_mb"])


@needs_tpu
def test_selftest_passes_on_this_tpu_vm(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "portable_fsdp.selftest", "--backend", "xla", "--workdir",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=3000,
                          env={**os.environ, **TPU_ENV})
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert report["device_kind"].startswith("TPU")


@needs_tpu
def test_the_hf_guides_tpu_file_runs_fsdp_v1_over_every_chip(tmp_path):
    """The Hugging Face guide's TPU fsdp_config, verbatim: FSDP v1 (one process per chip) with its bf16 compute, as
    Trainer runs it, and one warning recommending xla_fsdp_v2."""
    import json

    from tests.xla.test_cli import HF_TPU_CONFIG, RECOMMENDS_V2

    fsdp_json = tmp_path / "fsdp.json"
    fsdp_json.write_text(json.dumps(HF_TPU_CONFIG))
    proc = cli(["--fsdp_config", str(fsdp_json), "--config", TEST_RECIPE, "--workdir", str(tmp_path / "run"),
                "--config.train.log_every=1", *BATCH], cwd=tmp_path, env=TPU_ENV, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(RECOMMENDS_V2) == 1
    run_losses = losses(tmp_path / "run")
    assert len(run_losses) == 20 and run_losses[-1] < run_losses[0]
