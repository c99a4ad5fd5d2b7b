"""The background checkpoint writer process of train.async_save on torch (portable_fsdp/backends/torch/save_process.py), on 2
gloo ranks: save_process_check.py."""
import os
import subprocess
import sys

import psutil

from benchmarks.common import ROOT, free_port
from tests.dist.launch import torchrun


def test_each_rank_writes_through_its_own_process_which_survives_ctrl_c_and_reports_failures(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    torchrun(2, "tests/dist/save_process_check.py", str(tmp_path), timeout=300)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no writer outlives its rank
    assert (tmp_path / "four" / ".metadata").is_file() and not (tmp_path / "five").exists()


def test_the_writer_dies_with_its_rank_even_mid_save(tmp_path):
    """kill -9 of a rank (the OOM killer, a node's agent) takes its writer with it, even one busy in its group's
    collectives rather than waiting for the rank's next request."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "tests/dist/save_process_check.py", str(tmp_path), "hold"], cwd=ROOT,
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        said = next(line for line in ranks[0].stdout if not line.startswith("[Gloo]"))  # gloo's banner first
        writer = psutil.Process(int(said))
        assert writer.ppid() == ranks[0].pid
        ranks[0].kill()
        writer.wait(30)  # raises TimeoutExpired if it outlives its rank (its rendezvous alone waits 300 s)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_the_update_after_a_background_save_waits_for_its_copy_of_the_state(tmp_path):
    torchrun(2, "tests/dist/async_staging_check.py", str(tmp_path), timeout=300)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
