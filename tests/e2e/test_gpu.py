"""CUDA paths (`--backend cuda`, cp_impl=torch, compiled and float8 layers). Marked `gpu`: CI has no GPU and
skips them.

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


# ---------------------------------------------------------------- the fast path: compiled layers, float8 layers
FLOAT8 = GPUS >= 1 and torch.cuda.get_device_capability(0) >= (8, 9)
# bf16 against bf16: float8's rounding (e4m3 forward, e5m2 gradients) moves the losses by well under 1 %.
FLOAT8_RTOL = 2e-2
BF16 = ["--config.plan.param_dtype=bfloat16", "--config.plan.reduce_dtype=float32"]


def train(tmp_path, name, *flags, nproc=1):
    workdir = tmp_path / name
    proc = cli(["--backend", "cuda", "--nproc", str(nproc), "--config", TEST_RECIPE, "--workdir", str(workdir),
                "--config.train.log_every=1", *flags], cwd=tmp_path, timeout=900)
    return proc, workdir


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_cuda_compiled_layers_match_the_cpu_reference(tmp_path):
    proc, workdir = train(tmp_path, "compile", "--config.plan.compile=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_relative_difference(losses(workdir), reference_losses(make_config({}), 20)) <= CUDA_RTOL


@pytest.mark.skipif(not FLOAT8, reason="needs a GPU with float8 tensor cores (compute capability >= 8.9)")
@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_float8_layers_train_close_to_bf16(tmp_path, nproc):
    if nproc > GPUS:
        pytest.skip(f"needs {nproc} GPUs")
    plain, plain_dir = train(tmp_path, "bf16", *BF16, "--config.plan.compile=true", nproc=nproc)
    fast, fast_dir = train(tmp_path, "float8", *BF16, "--config.plan.compile=true", "--config.plan.float8=true",
                           nproc=nproc)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert fast.returncode == 0, fast.stderr[-3000:]
    difference = max_relative_difference(losses(fast_dir), losses(plain_dir))
    assert 0 < difference <= FLOAT8_RTOL, (losses(fast_dir), losses(plain_dir))


@pytest.mark.skipif(GPUS < 1 or FLOAT8, reason="needs a GPU without float8 tensor cores")
def test_cuda_float8_is_refused_on_a_gpu_without_float8(tmp_path):
    proc, workdir = train(tmp_path, "float8", "--config.plan.compile=true", "--config.plan.float8=true")
    assert proc.returncode == 2
    assert "error: plan.float8: needs float8 tensor cores (compute capability 8.9 or newer" in proc.stderr
    assert not (workdir / "metrics.jsonl").exists() or losses(workdir) == []
