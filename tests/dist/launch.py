"""Starting a multi-process CPU run for a test: torchrun on gloo, one thread per rank, the whole process
group killed on a timeout (workers are torchrun's children and would outlive it)."""
import json
import tempfile

from benchmarks.common import ROOT, run_python


def torchrun(nproc: int, *args: str, timeout: float = 900) -> None:
    """`python -m torch.distributed.run --nproc_per_node NPROC ARGS` from the repo root; fails the test with
    the ranks' stderr when it does not exit 0."""
    with tempfile.TemporaryDirectory(prefix="torchrun-") as agent_files:  # torchrun's default leaves one per run
        proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                           "--log-dir", agent_files, *args], timeout,
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})  # scripts import tests.*
    assert proc.returncode == 0, proc.stderr[-4000:]


def write_results(out: str, results: dict) -> None:
    """A check script's end, on every rank: rank 0 writes the results the test reads."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
