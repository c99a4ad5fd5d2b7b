"""CUDA paths (`--backend cuda`, cp_impl=torch). Marked `gpu`: CI has no GPU and skips them.

Run on a GPU machine:  python -m pytest -m gpu tests/e2e/test_gpu.py
"""
import pytest
import torch

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count()
# TF32 stays off for matmuls; cuDNN/flash SDPA kernels reorder sums: a few 1e-5 relative after 20 steps.
CUDA_RTOL = 1e-4


def losses(workdir):
    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_cuda_single_process_matches_the_cpu_reference(tmp_path):
    proc = cli(["--backend", "cuda", "--nproc", "1", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                "--config.train.log_every=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_relative_difference(losses(tmp_path), reference_losses(make_config({}), 20)) <= CUDA_RTOL


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("impl", ["torch", "portable"])
@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_cuda_context_parallel(tmp_path, impl, method):
    proc = cli(["--backend", "cuda", "--nproc", "2", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                "--config.train.log_every=1", "--config.plan.cp_size=2", f"--config.plan.cp_impl={impl}",
                f"--config.plan.cp_rotate_method={method}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_relative_difference(losses(tmp_path), reference_losses(make_config({}), 20)) <= CUDA_RTOL
