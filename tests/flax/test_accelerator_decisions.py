"""What the flax lowering does on a GPU or TPU host, decided with the accelerator injected (none here): JAX takes the
accelerator when JAX_PLATFORMS does not say otherwise (it used to be told to use the CPU), every local device by
default (counted by JAX in a process of its own), and memory is the allocator's, never the host's."""
import types

import pytest

from portable_fsdp.machine import host_memory, tpu_vm
from portable_fsdp.backends.flax import devices, resources
from portable_fsdp.errors import UserError


@pytest.mark.parametrize("tpu, libtpu, gpus, plugin, found", [
    (True, True, [], False, "tpu"), (True, False, [], False, None),
    (False, False, ["/dev/nvidia0"], True, "gpu"), (False, False, ["/dev/nvidia0"], False, None),
    (False, False, [], True, None)])
def test_the_accelerator_jax_takes_is_seen_without_importing_jax(monkeypatch, tpu, libtpu, gpus, plugin, found):
    monkeypatch.setattr(tpu_vm, "tpu_visible", lambda: tpu)
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: gpus)
    installed = {"libtpu"} if libtpu else set()
    installed |= set(devices.GPU_PLUGINS) if plugin else set()
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert devices.accelerator() == found


def test_an_accelerator_host_trains_on_every_local_device_by_default(monkeypatch):
    monkeypatch.setattr(devices, "accelerator", lambda: "gpu")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    seen = []

    def probe(command, **kwargs):
        seen.append(kwargs["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"])
        return types.SimpleNamespace(returncode=0, stdout="8\n", stderr="")

    monkeypatch.setattr(devices.subprocess, "run", probe)
    assert devices.default_count() == 8 and seen == ["false"]  # the probe takes no GPU memory
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert devices.default_count() == 2
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(devices.subprocess, "run",
                        lambda command, **kwargs: types.SimpleNamespace(returncode=1, stdout="", stderr="no GPU\n"))
    with pytest.raises(UserError, match="flax: JAX could not start on this host's gpu \\(no GPU\\)"):
        devices.default_count()


def device(platform, stats):
    return types.SimpleNamespace(platform=platform, memory_stats=lambda: stats)


def test_an_accelerators_memory_is_its_allocators_never_the_hosts(monkeypatch):
    MiB = 2**20
    gpu = device("gpu", {"bytes_in_use": 3 * MiB, "peak_bytes_in_use": 5 * MiB, "pool_bytes": 60 * MiB,
                         "peak_pool_bytes": 60 * MiB})
    assert resources.device_memory_mb(gpu) == {"mem_mb": 3.0, "peak_mem_mb": 5.0, "reserved_mb": 60.0,
                                               "peak_reserved_mb": 60.0}
    tpu = device("tpu", {"bytes_in_use": 3 * MiB, "peak_bytes_in_use": 5 * MiB})
    assert resources.device_memory_mb(tpu)["reserved_mb"] == 3.0  # no reserve reported: what is in use
    monkeypatch.setattr(host_memory, "resident_mb", lambda: 700.0)
    no_statistics = device("gpu", None)  # XLA_PYTHON_CLIENT_ALLOCATOR=platform
    assert set(resources.device_memory_mb(no_statistics).values()) == {0.0}
    assert resources.device_memory_mb(device("cpu", None))["mem_mb"] == 700.0
