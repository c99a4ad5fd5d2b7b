"""One run per workdir, as a user meets it: a second start while a run is live is refused with one line naming
that run (exit 2, nothing written); once the first run is killed with SIGKILL the next start takes the workdir over.
The lock itself (stale files, other machines, workers dying with their launcher) is tested in
tests/unit/test_workdir_lock.py."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from portable_fsdp import backends, run
from tests.conftest import ROOT, TEST_RECIPE

def wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def logged_a_step(workdir: pathlib.Path) -> bool:
    metrics = workdir / "metrics.jsonl"
    return metrics.exists() and '"loss"' in metrics.read_text()


def in_process(capsys, *args):
    code = run.main(["--config", TEST_RECIPE, *args])
    assert "WORLD_SIZE" not in os.environ  # a run in this process leaves its environment as it found it
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_live_run_refuses_a_second_start_and_a_killed_one_is_taken_over(tmp_path, capsys):
    workdir = tmp_path / "w"
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, "-m", "portable_fsdp.run", "--config", TEST_RECIPE, "--nproc", "1",
                                  "--workdir", str(workdir), "--config.train.steps=100000",
                                  "--config.train.log_every=1"],
                                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        backends.load("cpu")  # import torch here while the first run starts, not after
        wait_for(lambda: logged_a_step(workdir) or first.poll() is not None, 120, "the first run's first step")
        assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
        started = json.loads((workdir / ".lock").read_text())["started"]

        code, err = in_process(capsys, "--workdir", str(workdir))
        assert code == 2
        assert err == [f"error: --workdir: {workdir} is in use by a live run (host {socket.gethostname()}, "
                       f"pid {first.pid}, started {started}); choose another --workdir, or stop that run first"]
        records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        assert [r["event"] for r in records if "event" in r] == ["start"]  # only the first run's records
        assert sorted(p.name for p in workdir.iterdir()) == [".lock", "metrics.jsonl"]

        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert json.loads((workdir / ".lock").read_text())["pid"] == first.pid  # left behind by the kill

    code, err = in_process(capsys, "--workdir", str(workdir), "--nproc", "1",
                           "--config.train.steps=2", "--config.train.resume=true")
    assert code == 0, err
    assert err == [f"warning: --workdir: taking over {workdir} from a run that is no longer running (host "
                   f"{socket.gethostname()}, pid {first.pid}, started {started})",
                   f"warning: train.resume=true but {workdir} holds no checkpoint to resume from; starting from "
                   "step 0"]
    assert not (workdir / ".lock").exists()  # a run that ends gives the workdir back
