"""FSDP2's communication on CPU: our collectives equal gloo's, and a step moves the bytes the theory says."""
import json
import os

import pytest

from benchmarks.common import TINY_MODEL
from tests.dist.launch import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [*TINY_MODEL, "--config.data.seq_len=64", "--config.train.batch_size=4"]


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives") / "out.json"
    torchrun(3, os.path.join(ROOT, "tests", "dist", "cpu_collectives_check.py"), str(out))
    return json.loads(out.read_text())


def test_cpu_collectives_equal_gloo_with_and_without_shared_memory(collectives):
    differences = collectives["differences"]
    assert len(differences) == 5 * 4 * 7  # scenarios x sizes x (all-gather + 2 reduce-scatters x 3 ops)
    for case, difference in differences.items():
        # the all-gather copies bytes; sums may add 3 ranks in another order than gloo; MAX is gloo's own
        limit = 0.0 if "all_gather" in case or "/max/" in case else 1e-5
        assert difference <= limit, case


def test_shared_memory_falls_back_to_gloo_with_a_warning_and_leaves_no_files(collectives):
    usable = {scenario: buffers["usable"] for scenario, buffers in collectives["buffers"].items()}
    assert usable == {"": True, "rounds/": True, "no_shm/": False, "not_shared/": False, "late_failure/": False}
    assert collectives["warnings"][""] == collectives["warnings"]["rounds/"] == []
    assert any("buffer could be made" in w for w in collectives["warnings"]["no_shm/"])
    assert any("is not usable by every rank" in w for w in collectives["warnings"]["not_shared/"])
    assert any("buffer could be made" in w for w in collectives["warnings"]["late_failure/"])
    assert collectives["left_in_shm"] == []


def test_shared_buffers_grow_to_the_largest_round_and_no_further(collectives):
    """One pair of buffers serves both collectives: the largest call here is a reduce-scatter of 3000 elements
    per rank at 3 ranks, which shares 2 chunks of 4 bytes each (72,000 bytes); capped at 4 KB, it runs in
    rounds instead."""
    assert collectives["buffers"][""]["largest_buffer"] == 3 * 2 * 3000 * 4
    assert 0 < collectives["buffers"]["rounds/"]["largest_buffer"] <= 4096


@pytest.mark.parametrize("reshard", ["true", "false"])
def test_a_step_all_gathers_twice_and_reduce_scatters_once_the_parameters(tmp_path, reshard):
    """Per rank and step, in bandwidth-optimal bytes (P·(N-1)/N per pass over the parameters): all-gathers in
    forward and, for resharded units, again in backward (the root stays gathered: FSDP2's default), and one
    reduce-scatter. Counted where FSDP2 calls its comm objects (benchmarks/comm_worker.py)."""
    out = tmp_path / "comm.json"
    torchrun(2, "-m", "benchmarks.comm_worker", str(out), "steps", *TINY,
             f"--config.plan.reshard_after_forward={reshard}")
    result = json.loads(out.read_text())
    sent, half, root_half = result["sent_per_step"], result["param_bytes"] / 2, result["root_param_bytes"] / 2
    assert 0 < root_half < half
    expected_gathers = 2 * half - root_half if reshard == "true" else half
    assert sent["all_gather"] == pytest.approx(expected_gathers, rel=1e-3)
    assert sent["reduce_scatter"] == pytest.approx(half, rel=1e-3)
    assert sent["all_reduce"] < 100  # only the step's scalars: tokens, loss, gradient norm


def test_tensor_parallel_all_reduces_each_block_input_once(tmp_path):
    """Megatron's count of activation all-reduces per step at tp 2: per layer two in forward (after o_proj and
    down_proj) and two in backward (at the attention's input, q, k and v's gradients summed first, and at the
    MLP's), plus lm_head's input gradient: (4·L + 1) tensors of B·s·h fp32. One reduction per colwise layer's input
    gradient would make it 7·L + 1. Counted where torch dispatches each collective (benchmarks/comm_bytes.py)."""
    out = tmp_path / "comm.json"
    torchrun(2, "-m", "benchmarks.mesh_worker", str(out), "cpu", *TINY, "--config.plan.tp_size=2",
             "--config.plan.cpu_collectives=gloo")
    sent = json.loads(out.read_text())["sent_per_step"]
    layers, rows, seq_len, hidden = 2, 4, 64, 64  # TINY: every rank of the tp group reads the whole batch
    one_activation = rows * seq_len * hidden * 4 * 2 * (2 - 1) / 2  # an all-reduce over 2 ranks
    assert sent["all_reduce"] == pytest.approx((4 * layers + 1) * one_activation, abs=100)  # + the step's scalars
