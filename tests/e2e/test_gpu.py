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


# ---------------------------------------------------------------- what a first GPU run meets (each fixed on CPU first)
BF16_RTOL = 3e-2  # bf16 compute against the fp32 reference (the self-test's bound)
MIXTRAL = ["--config.model.architecture=mixtral",
           '--config.model.config_overrides={"num_local_experts": 4, "num_experts_per_tok": 2, '
           '"output_router_logits": true, "router_aux_loss_coef": 0.001, "sliding_window": null}']
MIXTRAL_REFERENCE = {"model.architecture": "mixtral", "model.config_overrides": '{"num_local_experts": 4, '
                     '"num_experts_per_tok": 2, "output_router_logits": true, "router_aux_loss_coef": 0.001, '
                     '"sliding_window": null}'}


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
@pytest.mark.parametrize("flags, rtol", [([], CUDA_RTOL), (BF16, BF16_RTOL),
                                         (["--config.plan.compile=true"], CUDA_RTOL)], ids=["fp32", "bf16", "compiled"])
def test_cuda_mixture_of_experts_runs_its_grouped_gemm(tmp_path, flags, rtol):
    """The experts run transformers' grouped_mm on CUDA (hf_torch/experts.py): torch's grouped GEMM for bfloat16,
    its fallback for float32, and one graph per layer when compiled."""
    proc, workdir = train(tmp_path, "moe", *MIXTRAL, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_relative_difference(losses(workdir), reference_losses(make_config(MIXTRAL_REFERENCE), 20)) <= rtol


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_offloaded_run_saves_in_the_background_resumes_and_exports(tmp_path, nproc):
    """Under plan.cpu_offload the shards live in host memory while the mesh is the GPUs': the export gathers them on
    the GPU, rank-0 loading broadcasts buffers that live on the GPU, the background save pins from a thread on the
    rank's own GPU."""
    if nproc > GPUS:
        pytest.skip(f"needs {nproc} GPUs")
    flags = ["--config.plan.cpu_offload=true", "--config.plan.state_dict_type=SHARDED_STATE_DICT",
             "--config.train.async_save=true", "--config.train.export_full_at_end=true",
             "--config.plan.cpu_ram_efficient_loading=true"]
    proc, workdir = train(tmp_path, "offload", *flags, "--config.train.stop_at_step=10", nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, workdir = train(tmp_path, "offload", *flags, "--config.train.resume=true", nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}
    assert max_relative_difference([records[s] for s in sorted(records)], reference_losses(make_config({}), 20)) \
        <= CUDA_RTOL
    assert any((workdir / "export").glob("*.safetensors"))
    start = next(r for r in read_metrics(workdir) if r.get("event") == "start")
    # the caching allocator holds at least what tensors hold; the base counts the CUDA context and NCCL
    assert all(r >= m for r, m in zip(start["reserved_mb"], start["mem_mb"]))
    assert all(base > 100 for base in start["base_mem_mb"])


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_selftest_passes_on_this_gpu_machine(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "portable_fsdp.selftest", "--backend", "cuda", "--workdir",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "selftest.json").read_text())
    rows = {row["feature"]: row for row in report["rows"]}
    assert "datasheet" in rows["matmul_bfloat16"]["figure"]  # a GPU the datasheet knows
