"""Starting `--backend xla`, and what the command asks of it before any worker starts. The environment torch_xla
reads is set before it is imported, every start-up check runs before anything compiles, then:

SPMD FSDPv2: one process per host drives all its devices, so the worker runs in this process; the plan's
    world size is the device count (on the CPU, `--nproc` PJRT CPU devices).
FSDP v1: one process per device, started by torch_xla's own launcher (xmp.spawn); on the CPU one device only.

On a TPU slice of several hosts the same command runs on every host (`gcloud compute tpus tpu-vm ssh NAME
--worker=all`, or xpk); torch_xla forms the slice from the TPU VMs' metadata, the plan spans every chip of it,
and worker 0 writes what one writer writes.
"""
from __future__ import annotations

import os
import pathlib

from portable_fsdp.launch import worker
from portable_fsdp.backends.xla import environment, fsdp_settings, layout
from portable_fsdp.machine import tpu_vm
from portable_fsdp.errors import UserError
from portable_fsdp.config.hf_import import xla_settings_onto_spmd_plan
from portable_fsdp.config.validate import resolve_plan
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
    """Several machines are the hosts of one TPU slice, which torch_xla forms itself (from TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES, else the VMs' metadata): the file must name the slice as it is, this host as itself."""
    if nodes.num_machines == 1:
        return
    worker, workers = tpu_vm.slice_workers()
    if workers == 1:
        raise UserError(f"{path}: num_machines", (
            f"= {nodes.num_machines}: --backend xla runs several machines only as the hosts of one TPU slice, and "
            "this host is not in one; set num_machines: 1"))
    if nodes.num_machines != workers:
        raise UserError(f"{path}: num_machines", (
            f"= {nodes.num_machines}, but this TPU slice has {workers} hosts, all of which torch_xla joins; set "
            f"num_machines: {workers}"))
    if nodes.machine_rank != worker:
        raise UserError(f"{path}: machine_rank", (
            f"= {nodes.machine_rank}, but this host is worker {worker} of its TPU slice, the rank torch_xla gives it; "
            f"set machine_rank: {worker} (or leave the file out: the slice needs none)"))


def check_slice_plan(plan, hosts: int) -> None:
    """SPMD over several hosts: each host sends its rows with torch_xla's `minibatch` input sharding, which in
    torch_xla 2.9 needs the batch dimension tiled over every device of the slice (XlaShardingSpec,
    csrc/init_python_bindings.cpp) and hands local device i block i of the host's rows with every token of them
    (ShardingUtil::GetShardIndicesForMinibatchTensor): devices that split a row (tp, sp, cp) cannot be fed so."""
    if hosts == 1:
        return
    for field, size in (("plan.tp_size", plan.mesh.tp_size), ("plan.sp_size", plan.mesh.sp_size),
                        ("plan.cp_size", plan.mesh.cp_size)):
        if size > 1:
            raise UserError(field, (
                f"= {size}: on a TPU slice of {hosts} hosts each host feeds whole rows of the batch to each of its "
                f"chips, so --backend xla splits the batch only (fsdp, dp_replicate, ep); set {field}=1, or run "
                "--backend flax"))


def owns_workdir(nodes) -> bool:
    """Under torchrun its rank 0; on a TPU slice (every host starts the command) worker 0."""
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    return tpu_vm.slice_workers()[0] == 0


def start_workers(config, spec: dict, workdir: pathlib.Path, nproc: int, nodes, checks) -> dict | None:
    """`checks(config, backend_name, world_size, workdir, device, lowering_checks) -> plan`: the launcher's shared
    checks (the capability table included), then this lowering's own (expert parallelism's batches). Returns the
    run's summary (None under FSDP v1, whose processes torch_xla starts). On a TPU slice of several hosts every
    host runs this; torch_xla joins them."""
    environment.configure(nproc)
    device = environment.device_type()
    v2 = config.plan.xla_fsdp_v2
    if not v2 and (device not in ("CPU", "TPU") or (device == "CPU" and nproc > 1)):
        world = nproc  # refused by the capability table below, before torch_xla counts devices
    else:
        world = environment.spmd_device_count(device, nproc) if v2 else environment.v1_process_count(device)
    if v2 and device == "TPU":  # before anything is written into the workdir
        check_slice_plan(resolve_plan(config, world), tpu_vm.slice_workers()[1])

    def spmd_checks(plan):
        if v2 and plan.mesh.ep_size > 1:
            layout.check_expert_batches(config, world)

    plan = checks(config, "xla", world, workdir, device=device, lowering_checks=spmd_checks)
    if v2:
        os.environ["WORLD_SIZE"] = str(world)  # what the worker resolves the plan against
        return worker.main(spec)
    # FSDP v1: its settings are checked against the installed torch_xla before its processes start.
    fsdp_settings.refuse_parts_under_v1(plan, spec["parts"].given() if spec.get("parts") else ())
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
