"""--backend flax over several machines: the jax.distributed.initialize arguments each launcher chooses (injected:
no TPU, no second machine here) — an Accelerate file's machines meet at its main process; the hosts of a TPU
slice join with none, which jax detects itself."""
import pytest

from portable_fsdp.backends.flax import launch
from portable_fsdp.config.accelerate import LaunchSettings

FILE = LaunchSettings(num_machines=2, machine_rank=1, main_process_ip="10.0.0.4", main_process_port=29500)


@pytest.mark.parametrize("nodes, platform, workers, expected", [
    (LaunchSettings(), "cpu", (0, 1), (0, 1, None)),
    (LaunchSettings(), "tpu", (0, 1), (0, 1, None)),  # v5p-8: one host
    (LaunchSettings(), "tpu", (1, 2), (1, 2, {})),  # v5p-16: jax.distributed.initialize() finds the slice
    (LaunchSettings(), "cpu", (1, 2), (0, 1, None)),  # a slice's host told to train on its CPU: alone
    (FILE, "cpu", (0, 1), (1, 2, {"coordinator_address": "10.0.0.4:29500", "num_processes": 2, "process_id": 1})),
    (FILE, "tpu", (1, 2), (1, 2, {"coordinator_address": "10.0.0.4:29500", "num_processes": 2, "process_id": 1})),
])
def test_machines_and_join_arguments(nodes, platform, workers, expected):
    assert launch.machines(nodes, platform, workers) == expected


def test_worker_1_of_a_slice_does_not_own_the_workdir(monkeypatch):
    """Asked before jax starts (it must join the slice first): the host's accelerator says TPU."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(launch, "accelerator", lambda: "tpu")
    monkeypatch.setattr(launch.tpu_vm, "slice_workers", lambda: (1, 2))
    assert launch.owns_workdir(LaunchSettings()) is False
    monkeypatch.setattr(launch.tpu_vm, "slice_workers", lambda: (0, 2))
    assert launch.owns_workdir(LaunchSettings()) is True
    monkeypatch.setattr(launch.tpu_vm, "slice_workers", lambda: (1, 2))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # told to train on its CPU: a run of its own
    assert launch.owns_workdir(LaunchSettings()) is True
