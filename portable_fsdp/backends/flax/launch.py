"""Starting `--backend flax`, and what the command asks of it before jax starts: one JAX process drives `--nproc`
devices (host CPU devices unless JAX_PLATFORMS or the host's accelerator names others), so there is no launcher
and the plan's world size is the device count. On several machines each machine's launcher is one JAX process
(machine_rank of num_machines, meeting at main_process_ip:main_process_port) and the world is every machine's
devices; on a TPU slice of several hosts, with no such file, each host's command is one JAX process of the slice,
which jax.distributed finds by itself. Nothing here imports jax: host devices are set up before it starts."""
from __future__ import annotations

import os
import pathlib

from portable_fsdp.launch import worker
from portable_fsdp.backends.flax.devices import (HOST_DEVICE_COUNT_FLAG, accelerator, configure_host_devices,
                                                 default_count, join, platform)
from portable_fsdp.errors import UserError
from portable_fsdp.launch.launcher import under_torchrun
from portable_fsdp.machine import tpu_vm


def device_type(backend: str) -> str:
    return platform()


def default_nproc(backend: str) -> int:
    return default_count()  # every device of the host's accelerator, else 2 CPU devices


def prepare_config(config) -> None:
    """The plan is read as it is."""


def check_machines(nodes, path: str) -> None:
    if nodes.rdzv_backend != "static":
        raise UserError(f"{path}: rdzv_backend", (
            f"{nodes.rdzv_backend}: --backend flax joins jax.distributed with machine_rank as the process id, which "
            f"{nodes.rdzv_backend} does not keep; write rdzv_backend: static"))


def owns_workdir(nodes) -> bool:
    """Asked before the launcher starts jax (which must join the other machines first): the platform the run will
    take, read from JAX_PLATFORMS or the host's accelerator, never from jax."""
    platform_ = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() or accelerator() or "cpu"
    return machines(nodes, platform_, tpu_vm.slice_workers())[0] == 0


def machines(nodes, platform_: str, slice_workers: tuple) -> tuple:
    """(this machine's process id, the machine count, jax.distributed.initialize's keyword arguments — None on one
    machine). An Accelerate file's machines meet at its main process; the hosts of a TPU slice (`slice_workers`:
    tpu_vm.slice_workers) join with no arguments, which jax detects from the same TPU_WORKER_* variables or VM
    metadata (jax/_src/clusters/cloud_tpu_cluster.py: GceTpuCluster, GkeTpuCluster)."""
    if nodes.multi_node:
        return nodes.machine_rank, nodes.num_machines, {
            "coordinator_address": f"{nodes.main_process_ip}:{nodes.main_process_port}",
            "num_processes": nodes.num_machines, "process_id": nodes.machine_rank}
    worker, workers = slice_workers
    if platform_ == "tpu" and workers > 1:
        return worker, workers, {}
    return 0, 1, None


def sharded_format() -> str:
    return "orbax"


def convert_sharded(source: pathlib.Path, target: pathlib.Path) -> None:
    raise UserError("source", (
        f"{source} is a SHARDED_STATE_DICT checkpoint of --backend flax (orbax files), which this converter does "
        "not read; run with --config.train.export_full_at_end=true for its FULL weights, or resume it on "
        "--backend flax with --config.plan.state_dict_type=FULL_STATE_DICT, whose saves are FULL"))


def estimate_devices(backend: str) -> tuple:
    return ("cpu", "gpu", "tpu")


def estimator_environment(nproc: int) -> dict:
    """N host devices stand in for the N accelerators."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICE_COUNT_FLAG)]
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICE_COUNT_FLAG}={nproc}"])}


def start_workers(config, spec: dict, workdir: pathlib.Path, nproc: int, nodes, checks) -> dict:
    if under_torchrun():
        raise UserError("--backend", "flax runs as one process driving every device; start it without torchrun")
    configure_host_devices(nproc)
    machine, machine_count, join_arguments = machines(nodes, platform(), tpu_vm.slice_workers())
    world_size = nproc * machine_count
    checks(config, "flax", world_size, workdir, device=platform())
    if join_arguments is not None:
        join(join_arguments)
    os.environ.update(RANK=str(machine), WORLD_SIZE=str(world_size))
    return worker.main(spec)
