"""The JAX devices of a run: one process, or one process per machine (an Accelerate YAML's num_machines).

XLA reads its platform and host-device count once, when jax is first imported, so the launcher calls
`configure_host_devices` before anything imports jax: on a host without an accelerator JAX can use, one process
then drives N CPU devices, the stand-in for N accelerators; on a GPU or TPU host JAX takes the accelerator.
A JAX_PLATFORMS the user already set (e.g. cuda, tpu, cpu) is respected.
On several machines (or the hosts of a TPU slice) each launcher then `join`s JAX's multi-process runtime before any
device is touched:
`jax.devices()` becomes every machine's devices, and the lowering's programs span them all.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

from portable_fsdp.machine import tpu_vm
from portable_fsdp.errors import UserError

HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# The PJRT plugins JAX takes a GPU with (jax[cuda12], jax[cuda13]).
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def accelerator() -> str | None:
    """The accelerator JAX takes on this host, seen without importing jax: "tpu" (TPU chips, and libtpu to drive
    them), "gpu" (an NVIDIA GPU, and JAX's CUDA plugin), else None."""
    if tpu_vm.tpu_visible() and importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*") and any(importlib.util.find_spec(name) for name in GPU_PLUGINS):
        return "gpu"
    return None


def configure_host_devices(count: int | None) -> None:
    """Before jax is imported: its platform (JAX_PLATFORMS when set; the host's accelerator; else `count` CPU
    devices)."""
    if "jax" in sys.modules:
        return  # too late to change anything; `take` checks that enough devices exist
    if not os.environ.get("JAX_PLATFORMS") and accelerator() is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if count:  # read by the CPU client alone
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICE_COUNT_FLAG)]
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"{HOST_DEVICE_COUNT_FLAG}={count}"])


def default_count() -> int:
    """Devices a run takes when --nproc is not given: every device of this host's accelerator (counted by JAX in a
    process of its own, so this one can still fork and join before JAX starts), else 2 CPU devices."""
    if accelerator() is None or os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        return 2
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.local_device_count())"],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError("--backend", f"flax: JAX could not start on this host's {accelerator()} ({last[:200]}); "
                        "set JAX_PLATFORMS=cpu to train on the host, or give --nproc")
    return int(probe.stdout.split()[-1])


JOIN_TIMEOUT_S = 300  # how long a machine waits for the others to start


def join(arguments: dict) -> None:
    """This machine's process joins the others (jax.distributed; the coordinator runs in process 0): `arguments`
    name the coordinator, the process count and this process's id, or are empty on a TPU slice, which jax finds
    by itself. Host CPU devices reach each other's over gloo, which must be chosen before the CPU client exists."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**arguments, initialization_timeout=JOIN_TIMEOUT_S)
    except Exception as err:  # jax raises its runtime's errors (a timeout, a refused connection) as is
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if not arguments:
            raise UserError("--backend", (
                f"flax: this TPU host could not join its slice's other hosts within {JOIN_TIMEOUT_S} s "
                f"({first[:200]}); start the same command on every worker (--worker=all)")) from None
        raise UserError("main_process_ip", (
            f"machine {arguments['process_id']} could not join the {arguments['num_processes']} machines at "
            f"{arguments['coordinator_address']} within {JOIN_TIMEOUT_S} s ({first[:200]}); start every machine's "
            "command, with the same main_process_ip and main_process_port")) from None


def platform() -> str:
    """The platform the run's devices are on: the first JAX_PLATFORMS entry (the launcher sets it before jax
    starts), else the host's accelerator before jax starts (the launcher may still join other machines), else
    what jax itself picked (a notebook)."""
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"].split(",")[0].strip()
    if "jax" not in sys.modules and accelerator():
        return accelerator()
    import jax

    return jax.devices()[0].platform


def take(count: int) -> list:
    """`count` devices, the same number from each process (its first ones: a test process may hold more than one
    run uses), in process order."""
    import jax

    processes = jax.process_count()
    per_process = count // processes
    local = jax.local_devices()
    if count % processes or len(local) < per_process:
        platform_ = local[0].platform
        why = ("jax was initialised before the host devices could be set up" if platform_ == "cpu"
               else f"give --nproc at most {len(local)}")
        raise UserError("--nproc", f"the plan needs {count} JAX devices, {per_process} from each of {processes} "
                        f"processes, but this process has {len(local)} ({platform_}); {why}")
    return [d for p in range(processes) for d in [d for d in jax.devices() if d.process_index == p][:per_process]]
