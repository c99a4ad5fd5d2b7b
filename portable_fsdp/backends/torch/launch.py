"""Starting `--backend cpu|cuda`, and what the command asks of it before any worker starts. One process per
device: under torchrun its environment is used as it is; otherwise torch's own elastic launcher starts `--nproc`
local processes (one process runs in place), on one machine or — from an Accelerate YAML's num_machines —
joining the other machines' launchers in one rendezvous."""
from __future__ import annotations

import logging
import os
import pathlib
import sys
import tempfile
import uuid

from portable_fsdp.launch import cluster, worker
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError
from portable_fsdp.launch.launcher import rendezvous_port, under_torchrun


def device_type(backend: str) -> str:
    return backend  # --backend cpu and cuda are named after their device


def default_nproc(backend: str) -> int:
    if backend == "cuda":
        import torch

        return torch.cuda.device_count()
    return 2


def prepare_config(config) -> None:
    """The plan is read as it is."""


def check_machines(nodes, path: str) -> None:
    """torch's elastic launcher joins any number of machines."""


def owns_workdir(nodes) -> bool:
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    return nodes.machine_rank == 0


def sharded_format() -> str:
    return "torch.distributed.checkpoint"


def estimate_devices(backend: str) -> tuple:
    return (backend,)


def estimator_environment(nproc: int) -> dict:
    return {}  # the fake process group stands in for any world size


def start_workers(config, spec: dict, workdir: pathlib.Path, nproc: int, nodes, checks) -> dict | None:
    backend = spec["backend"]
    if under_torchrun():  # every rank checks (cheap, deterministic) before any collective starts
        checks(config, backend, int(os.environ["WORLD_SIZE"]), workdir)
        return worker.main(spec)
    checks(config, backend, nproc * nodes.num_machines, workdir)
    if nproc == 1 and not nodes.multi_node:
        with cluster.rank_environment(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port(nodes.main_process_port))):
            return worker.main(spec)
    for key, given in (("callbacks", spec.get("callbacks")), ("parts", spec.get("parts") and spec["parts"].given())):
        if given:  # Python objects of this process: the started workers could not call them
            name = key if key == "callbacks" else ", ".join(given)
            raise UserError(name, (f"live in this process, where started workers cannot call them: use nproc=1 "
                                   f"(got {nproc}), or call train under torchrun, where every process passes its own"))
    return _elastic_launch(spec, nproc, nodes)


def _rendezvous(nodes) -> dict:
    """LaunchConfig's rendezvous fields. One machine: c10d on 127.0.0.1. Several: every machine's launcher meets
    at main_process_ip:main_process_port under one run id; `static` (Accelerate's default) makes machine_rank
    the node rank and machine 0 host the store, `c10d` numbers the nodes as they join."""
    if not nodes.multi_node:
        return dict(min_nodes=1, max_nodes=1, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                    rdzv_endpoint=f"127.0.0.1:{rendezvous_port(nodes.main_process_port)}")
    if nodes.rdzv_backend == "static" and nodes.machine_rank == 0:
        rendezvous_port(nodes.main_process_port)  # machine 0 hosts the store: a clash is one line, not a hang
    return dict(min_nodes=nodes.num_machines, max_nodes=nodes.num_machines, rdzv_backend=nodes.rdzv_backend,
                run_id=f"portable_fsdp-{nodes.main_process_port}",
                rdzv_endpoint=f"{nodes.main_process_ip}:{nodes.main_process_port}",
                rdzv_configs={"rank": nodes.machine_rank} if nodes.rdzv_backend == "static" else {})


def _elastic_launch(spec: dict, nproc: int, nodes) -> dict | None:
    """Rank 0's summary (the launcher returns {global rank: what worker.main returned} for this machine's
    workers: None on the other machines); SystemExit on a failure."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = {**spec, "launcher_pid": os.getpid()}  # the workers stop if this process dies (worker.main)
    # A failed worker is named once: by its own `error:` line or by `report_failure`. torch would log its agent's
    # polling traceback besides, and each worker it then stops.
    for logger in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    # The agent's per-worker error files live only as long as the launch: left to torch, every run would leave
    # a torchelastic_* directory in the user's temporary directory.
    with tempfile.TemporaryDirectory(prefix="portable_fsdp-launch-") as agent_files:
        launch_config = LaunchConfig(nproc_per_node=nproc, max_restarts=0, monitor_interval=0.1, start_method="spawn",
                                     logs_specs=DefaultLogsSpecs(log_dir=agent_files), **_rendezvous(nodes))
        try:
            return elastic_launch(launch_config, worker.main)(spec).get(0)
        except ChildFailedError as err:
            raise SystemExit(report_failure(err)) from None
        except SignalException as err:  # the launcher was signalled; the agent has already stopped every worker
            print(f"error: interrupted by {err.sigval.name}; workers stopped", file=sys.stderr)
            raise SystemExit(Interrupted.exit_code) from None


def _message(failure) -> str:
    message = failure.message
    return message.get("message", "") if isinstance(message, dict) else str(message)


def _lost_peer(failure) -> bool:
    text = _message(failure)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def report_failure(err) -> int:
    """The exit status of a launch whose workers failed (torch's ChildFailedError). Workers print their own
    `error:` line for user errors (exit 2); anything else is named here."""
    failures = err.failures
    reported = (UserError.exit_code, TrainingDiverged.exit_code, Interrupted.exit_code)  # printed by workers
    codes = {f.exitcode for f in failures.values()}
    if codes <= set(reported):
        return max(codes)
    # The root cause is the earliest failure that is not a lost connection: once one rank dies, the
    # others fail on the closed connection to it (timestamps only have whole seconds).
    rank, failure = min(((r, f) for r, f in failures.items() if f.exitcode not in reported),
                        key=lambda item: (_lost_peer(item[1]), item[1].timestamp, item[0]))
    message = _message(failure)
    first = (str(message).strip().splitlines() or ["(no message)"])[-1]
    if failure.exitcode < 0:
        first = f"killed by signal {-failure.exitcode}"
    print(f"error: worker rank {rank} failed (exit code {failure.exitcode}): {first}", file=sys.stderr)
    return 1
