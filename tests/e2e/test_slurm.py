"""`srun python -m portable_fsdp.run ...` on two nodes, stood on this machine: each "node" is a command run with the
environment srun gives it (static values, gloo, one shared workdir as the nodes share a disk). One task per node
(our launcher starts its ranks) and one task per rank both train as one node's run of the same ranks, bit for bit."""
import pytest

from benchmarks.common import free_port, run_python
from tests.e2e.machines import ARGS, ENV, files, losses, own_lines, records, run_together
from tests.unit.test_cluster import slurm_step

# The first host of the nodelist is where the nodes meet: here both names are this machine.
NODELIST = "localhost,127.0.0.1"


def srun(tasks_per_node: int, args: list, shared) -> list:
    """Every task of `srun --nodes 2 --ntasks-per-node N python ARGS --workdir SHARED`; returns their (stdout,
    stderr), node 0's first."""
    port = str(free_port())
    return run_together([([*args, "--workdir", str(shared)],
                          slurm_step(2, tasks_per_node, task, nodelist=NODELIST, MASTER_PORT=port))
                         for task in range(2 * tasks_per_node)])


def one_node(tmp_path, nproc: int):
    one = tmp_path / "one"
    proc = run_python([*ARGS, "--nproc", str(nproc), "--workdir", str(one)], 300, ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(one)) == 6
    return one


def assert_same_run(shared, one):
    assert losses(shared) == losses(one)  # bit for bit, as the Accelerate two-machine test measures
    assert [sorted(r) for r in records(shared)] == [sorted(r) for r in records(one)]  # rank 0 wrote each once
    assert files(shared) == files(one)  # the same checkpoint: every rank's files, one commit


def test_one_task_per_node_matches_one_node(tmp_path):
    """`srun --ntasks-per-node=1 ... --nproc 1` on 2 nodes: node 1's launcher joins node 0's at the nodelist's first
    host; the run is one node's `--nproc 2`."""
    shared = tmp_path / "shared"
    outputs = srun(1, [*ARGS, "--nproc", "1"], shared)
    assert "cpu, 2 rank(s)" in outputs[0][0]
    assert own_lines(outputs[1][0]) == []  # node 1 prints no summary
    assert_same_run(shared, one_node(tmp_path, 2))


@pytest.mark.slow  # 4 ranks on 2 cores; one task per node runs by default above, the variables are unit-tested
def test_one_task_per_rank_matches_one_node(tmp_path):
    """`srun --ntasks-per-node=2` on 2 nodes: each task is one rank (SLURM_PROCID, SLURM_LOCALID), as torchrun
    would start it; the run is one node's `--nproc 4`."""
    shared = tmp_path / "shared"
    outputs = srun(2, ARGS, shared)
    assert "cpu, 4 rank(s)" in outputs[0][0]
    assert all(own_lines(out) == [] for out, _ in outputs[1:])  # rank 0 alone prints the summary
    assert_same_run(shared, one_node(tmp_path, 4))
