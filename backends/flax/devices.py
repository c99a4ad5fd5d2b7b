"""The JAX devices of a run: one process, or one process per machine (an Accelerate YAML's num_machines).

XLA reads its platform and host-device count once, when jax is first imported, so the launcher calls
`configure_host_devices` before anything imports jax: one process then drives N CPU devices, the
stand-in for N accelerators. A JAX_PLATFORMS the user already set (e.g. cuda, tpu) is respected.
On several machines each launcher then `join`s JAX's multi-process runtime before any device is touched:
`jax.devices()` becomes every machine's devices, and the lowering's programs span them all.
"""
from __future__ import annotations

import os
import sys

from portable_fsdp.errors import UserError

HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def configure_host_devices(count: int) -> None:
    if "jax" in sys.modules:
        return  # too late to change anything; `take` checks that enough devices exist
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{HOST_DEVICE_COUNT_FLAG}={count}"])


JOIN_TIMEOUT_S = 300  # how long a machine waits for the others to start


def join(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """This machine's process becomes `process_id` of `num_processes` (jax.distributed; the coordinator runs in
    process 0). Host CPU devices reach each other's over gloo, which must be chosen before the CPU client exists."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=JOIN_TIMEOUT_S)
    except Exception as err:  # jax raises its runtime's errors (a timeout, a refused connection) as is
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError("main_process_ip", (
            f"machine {process_id} could not join the {num_processes} machines at {coordinator_address} within "
            f"{JOIN_TIMEOUT_S} s ({first[:200]}); start every machine's command, with the same main_process_ip "
            "and main_process_port")) from None


def platform() -> str:
    """The platform the run's devices are on: the first JAX_PLATFORMS entry (the launcher sets it before jax
    starts), else what jax itself picked (a notebook on a GPU or TPU host)."""
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"].split(",")[0].strip()
    import jax

    return jax.devices()[0].platform


def take(count: int) -> list:
    """The first `count` devices (a test process may hold more than one run uses)."""
    import jax

    devices = jax.devices()
    if len(devices) < count:
        raise UserError("--nproc", (
            f"the plan needs {count} JAX devices but this process has {len(devices)} "
            f"({devices[0].platform}); jax was initialised before the host devices could be set up"))
    return devices[:count]
