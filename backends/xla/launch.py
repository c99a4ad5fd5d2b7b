"""Starting `--backend xla`: the environment torch_xla reads is set before it is imported, every start-up
check runs before anything compiles, then:

SPMD FSDPv2: one process per host drives all its devices, so the worker runs in this process; the plan's
    world size is the device count (on the CPU, `--nproc` PJRT CPU devices).
FSDP v1: one process per device, started by torch_xla's own launcher (xmp.spawn); on the CPU one device only.
"""
from __future__ import annotations

import os
import pathlib

from portable_fsdp import worker
from portable_fsdp.backends.xla import environment, fsdp_settings


def start(config, spec: dict, workdir: pathlib.Path, nproc: int, preflight) -> dict | None:
    """`preflight(config, backend_name, world_size, workdir, device) -> plan`: the launcher's shared checks
    (the capability table included). Returns the run's summary (None under FSDP v1, whose processes torch_xla
    starts); a failed run prints its `error:` line and raises SystemExit, as `portable_fsdp.launch.start` says."""
    environment.configure(nproc)
    device = environment.device_type()
    v2 = config.plan.xla_fsdp_v2
    if not v2 and (device not in ("CPU", "TPU") or (device == "CPU" and nproc > 1)):
        world = nproc  # refused by the capability table below, before torch_xla counts devices
    else:
        world = environment.spmd_device_count(device, nproc) if v2 else environment.v1_process_count(device)
    plan = preflight(config, "xla", world, workdir, device=device)
    if v2:
        os.environ["WORLD_SIZE"] = str(world)  # what the worker resolves the plan against
        return worker.main(spec)
    # FSDP v1: its settings are checked against the installed torch_xla before its processes start.
    fsdp_settings.v1_kwargs(plan, plan.xla.xla_fsdp_settings, fsdp_settings.v1_signature(), config.train.weight_decay)
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_v1_process, args=(spec,), nprocs=1 if device == "CPU" else None)
    return None


def _v1_process(index: int, spec: dict) -> None:
    """One FSDP v1 process (module level: xmp.spawn pickles it)."""
    import torch_xla.runtime as xr

    os.environ["WORLD_SIZE"] = str(xr.world_size())
    os.environ["RANK"] = str(xr.global_ordinal())
    worker.main(spec)
