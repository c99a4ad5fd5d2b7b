"""--backend xla on a TPU slice of several hosts, decided before torch_xla starts (the slice injected: no TPU here):
what an Accelerate file's num_machines means, which plans the hosts can feed, which host owns the workdir, and
what each host writes into a checkpoint."""
import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from portable_fsdp.backends.xla import launch
from portable_fsdp.checkpoint import files as checkpoint_files
from portable_fsdp.config.accelerate import LaunchSettings
from portable_fsdp.machine import tpu_vm
from tests.conftest import ROOT, TEST_RECIPE
from tests.unit._helpers import user_error


@pytest.fixture
def slice_of(monkeypatch):
    """Make this host worker `worker` of a slice of `workers` hosts."""
    def make(worker: int, workers: int) -> None:
        monkeypatch.setattr(tpu_vm, "slice_workers", lambda: (worker, workers))
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    return make


def machines(num_machines: int, machine_rank: int = 0) -> LaunchSettings:
    return LaunchSettings(num_machines=num_machines, machine_rank=machine_rank, main_process_ip="10.0.0.4")


def test_a_file_naming_the_slice_as_it_is_is_accepted(slice_of):
    slice_of(1, 2)
    launch.check_machines(machines(2, 1), "acc.yaml")
    launch.check_machines(machines(1), "acc.yaml")


@pytest.mark.parametrize("worker, workers, nodes, field, phrase", [
    (0, 1, machines(2), "acc.yaml: num_machines", "only as the hosts of one TPU slice, and this host is not in one"),
    (0, 4, machines(2), "acc.yaml: num_machines", "= 2, but this TPU slice has 4 hosts, all of which torch_xla joins; "
                                                  "set num_machines: 4"),
    (1, 2, machines(2, 0), "acc.yaml: machine_rank", "= 0, but this host is worker 1 of its TPU slice, the rank "
                                                     "torch_xla gives it; set machine_rank: 1"),
])
def test_a_file_that_disagrees_with_the_slice_is_one_line(slice_of, worker, workers, nodes, field, phrase):
    slice_of(worker, workers)
    with user_error(field, phrase):
        launch.check_machines(nodes, "acc.yaml")


def mesh(tp: int = 1, sp: int = 1, cp: int = 1):
    return SimpleNamespace(mesh=SimpleNamespace(tp_size=tp, sp_size=sp, cp_size=cp))


def test_hosts_feed_plans_that_split_the_batch_only():
    launch.check_slice_plan(mesh(), 2)
    launch.check_slice_plan(mesh(tp=4), 1)  # one host: rows are cut on its own devices
    with user_error("plan.tp_size", "= 2: on a TPU slice of 2 hosts each host feeds whole rows of the batch"):
        launch.check_slice_plan(mesh(tp=2), 2)
    with user_error("plan.cp_size", "set plan.cp_size=1, or run --backend flax"):
        launch.check_slice_plan(mesh(cp=2), 4)


@pytest.mark.parametrize("worker, owns", [(0, True), (1, False)])
def test_worker_0_owns_the_workdir(slice_of, worker, owns):
    slice_of(worker, 2)
    assert launch.owns_workdir(LaunchSettings()) is owns


def record(rank: int, full: bool, calls: list) -> checkpoint_files.Writer:
    """A Writer whose every function records its name: which of them host `rank` runs."""
    def named(name, files=None):
        def call(*args):
            calls.append(name)
            return dict(files or {})
        return call
    return checkpoint_files.Writer(
        rank=rank, full=full, weights=named("weights"), optimizer_state=named("gather optimizer"),
        model_config=named("config.json"), sharded=named("sharded"),
        torch_save=lambda obj, f: calls.append(f"save {pathlib.Path(getattr(f, 'path', f)).name}"),
        rng_state=named("rng"))


@pytest.mark.parametrize("full, host, expected", [
    (True, 0, ["gather optimizer", "save optimizer.pt", "weights", "config.json", "rng", "save rank_00000.pt"]),
    (True, 1, ["gather optimizer", "weights", "rng", "save rank_00001.pt"]),
    (False, 0, ["config.json", "rng", "save rank_00000.pt", "sharded"]),
    (False, 1, ["rng", "save rank_00001.pt", "sharded"]),
])
def test_host_0_writes_what_one_writer_writes(tmp_path, full, host, expected):
    """The xla backend's Writer has rank = the host's process index (xr.process_index under SPMD): host 0 alone
    writes optimizer.pt and config.json; every host its own shards (of the weights in FULL, whose gather every host
    joins) and its RNG state. The manifest and `latest` follow in the checkpoint session, on rank 0 alone."""
    calls = []
    checkpoint_files.write(record(host, full, calls), tmp_path)
    assert sorted(calls) == sorted(expected)


def test_a_slice_without_workdir_is_one_line(monkeypatch, capsys):
    """Every host would pick its own time-stamped default workdir: the command asks for one they share."""
    from portable_fsdp import run

    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert run.main(["--backend", "xla", "--config", TEST_RECIPE]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --workdir: TPU slice hosts: 2 needs --workdir, one directory every machine writes to "
        "(gs://bucket/run, or a shared mount): checkpoints hold every machine's files"]


HOST_SLICE = """
import json
import torch_xla.runtime as xr
xr.use_spmd()
from portable_fsdp.backends.xla import runtime
print(json.dumps([xr.process_index(), xr.process_count(), runtime._host_data_slice(xr.global_runtime_device_count())]))
"""


def test_a_host_reads_its_devices_mesh_positions_from_torch_xla():
    """torch_xla's names of this process's devices ("CPU:0", "TPU:4") give their mesh positions: one host of 4 PJRT
    CPU devices feeds the whole batch. (PJRT CPU is one process, so a second host cannot be started here.)"""
    proc = subprocess.run([sys.executable, "-c", HOST_SLICE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, 1, [0, 1]]
