"""FSDP2's communication on CPU: our collectives equal gloo's, and a step moves the bytes the theory says."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.model.hidden_size=64", "--config.model.intermediate_size=160", "--config.model.num_hidden_layers=2",
        "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2", "--config.data.seq_len=64",
        "--config.train.batch_size=4"]


def torchrun(nproc: int, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                           *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_cpu_collectives_equal_gloo_and_leave_no_shared_files(tmp_path):
    torchrun(3, os.path.join(ROOT, "tests", "dist", "cpu_collectives_check.py"), str(tmp_path / "out.json"))
    result = json.loads((tmp_path / "out.json").read_text())
    differences = result["differences"]
    assert len(differences) == 4 * 7
    for case, difference in differences.items():
        # the all-gather copies bytes; sums may add 3 ranks in another order than gloo; MAX is gloo's own
        limit = 0.0 if case.startswith("all_gather") or "/max/" in case else 1e-5
        assert difference <= limit, case
    assert result["left_in_shm"] == []


@pytest.mark.parametrize("reshard,passes", [("true", 3), ("false", 2)])
def test_a_step_all_gathers_and_reduce_scatters_k_times_the_parameters(tmp_path, reshard, passes):
    """Per rank and step: all-gathers (forward, and backward when resharded) and one reduce-scatter, each
    P·(N-1)/N bytes — counted on every torch.distributed call the step makes (benchmarks/comm_worker.py)."""
    out = tmp_path / "comm.json"
    torchrun(2, "-m", "benchmarks.comm_worker", str(out), "steps", *TINY,
             f"--config.plan.reshard_after_forward={reshard}")
    result = json.loads(out.read_text())
    sent, half = result["sent_per_step"], result["param_bytes"] / 2
    assert sent["all_gather"] == pytest.approx((passes - 1) * half, rel=1e-3)
    assert sent["reduce_scatter"] == pytest.approx(half, rel=1e-3)
    assert sent["all_reduce"] < 100  # only the step's scalars: tokens, loss, gradient norm
