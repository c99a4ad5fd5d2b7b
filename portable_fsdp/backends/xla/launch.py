"""Starting `--backend xla`, and what the command asks of it before any worker starts. The environment torch_xla
reads is set before it is imported, every start-up check runs before anything compiles, then:

SPMD FSDPv2: one process per host drives all its devices, so the worker runs in this process; the plan's
    world size is the device count (on the CPU, `--nproc` PJRT CPU devices).
FSDP v1: one process per device, started by torch_xla's own launcher (xmp.spawn); on the CPU one device only.
"""
from __future__ import annotations

import os
import pathlib

from portable_fsdp.launch import worker
from portable_fsdp.backends.xla import environment, fsdp_settings
from portable_fsdp.errors import UserError
from portable_fsdp.config.hf_import import xla_settings_onto_spmd_plan
from portable_fsdp.launch.launcher import under_torchrun


def device_type(backend: str) -> str:
    return environment.device_type()


def default_nproc(backend: str) -> int:
    return 2  # PJRT CPU devices; on a TPU the plan spans every chip of the slice whatever --nproc says


def prepare_config(config) -> None:
    xla_settings_onto_spmd_plan(config)


def estimate_devices(backend: str) -> tuple:
    return ("tpu", "cpu")


def estimator_environment(nproc: int) -> dict:
    return {}  # estimated from the torch model's trace and the SPMD partition specs: no torch_xla


def sharded_format() -> str:
    return "torch_xla shard files"  # portable_fsdp/backends/xla/shard_files.py


def convert_sharded(source: pathlib.Path, target: pathlib.Path) -> None:
    raise UserError("source", (
        f"{source} is a SHARDED_STATE_DICT checkpoint of --backend xla (one file per device), which this converter "
        "does not read; run with --config.train.export_full_at_end=true for its FULL weights, or resume it on "
        "--backend xla with --config.plan.state_dict_type=FULL_STATE_DICT, whose saves are FULL"))


def check_machines(nodes, path: str) -> None:
    raise UserError(f"{path}: num_machines", (
        f"= {nodes.num_machines}: the xla backend's launcher starts one host; set num_machines: 1"))


def owns_workdir(nodes) -> bool | None:
    """Under torchrun its rank 0; on a TPU slice (every host starts the command) worker 0, read once the
    environment is set up (None before)."""
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    if not environment.configured():
        return None
    return _tpu_worker() == 0


def _tpu_worker() -> int:
    """This host's worker number in its TPU slice (0 off a TPU), read from the TPU VM's metadata without starting
    torch_xla's runtime."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return 0
    from torch_xla._internal import tpu

    try:
        return tpu.worker_id()
    except Exception:  # no metadata: torch_xla's own start will say what is wrong
        return 0


def start_workers(config, spec: dict, workdir: pathlib.Path, nproc: int, nodes, checks) -> dict | None:
    """`checks(config, backend_name, world_size, workdir, device) -> plan`: the launcher's shared checks (the
    capability table included). Returns the run's summary (None under FSDP v1, whose processes torch_xla
    starts). One machine only: a multi-machine Accelerate file is refused before this (accelerate_launch)."""
    environment.configure(nproc)
    device = environment.device_type()
    v2 = config.plan.xla_fsdp_v2
    if not v2 and (device not in ("CPU", "TPU") or (device == "CPU" and nproc > 1)):
        world = nproc  # refused by the capability table below, before torch_xla counts devices
    else:
        world = environment.spmd_device_count(device, nproc) if v2 else environment.v1_process_count(device)
    plan = checks(config, "xla", world, workdir, device=device)
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
