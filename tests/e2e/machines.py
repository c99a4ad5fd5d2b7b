"""What the tests that stand several machines on this one share: the training command they run, one process
started per "machine" (its own environment; one shared workdir as machines sharing a disk, or a bucket with a local
copy each), and what a run leaves to compare (metrics, files)."""
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

from benchmarks.common import ROOT
from tests.conftest import TEST_RECIPE

ARGS = ["-m", "portable_fsdp.run", "--config", TEST_RECIPE, "--config.train.steps=6", "--config.train.log_every=1",
        "--config.train.progress_bar=false"]
ENV = {"OMP_NUM_THREADS": "1"}


def records(workdir):
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(workdir) if "loss" in r]


def files(workdir):
    return sorted(str(p.relative_to(workdir)) for p in pathlib.Path(workdir).rglob("*"))


def own_lines(output):
    """What a machine printed besides gloo's connection line and the token cache's build report (its node-local
    rank 0 may be the one that builds the cache both machines share here)."""
    return [line for line in output.splitlines() if not line.startswith(("[Gloo]", "data: "))]


def start(args, env: dict | None = None):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "USE_TORCH_XLA": "0", **ENV, **(env or {})})


def run_together(commands: list, timeout: float = 400, succeed: bool = True) -> list:
    """Start every (args, environment) of `commands` at once, as each machine starts its own; all must exit 0
    (with `succeed`). Returns their (stdout, stderr); every process group is killed on a timeout."""
    procs = [start(args, env) for args, env in commands]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0 or not succeed, err[-3000:]
    return outputs
