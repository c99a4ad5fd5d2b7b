"""Start the workers: under torchrun, use its environment; otherwise torch's own elastic launcher
starts `--nproc` local processes (one process runs in place), on one machine or — from an Accelerate YAML's
num_machines — joining the other machines' launchers in one rendezvous. Validation happens here, before any
worker starts, so a bad config costs seconds and prints one line."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
import socket
import sys
import tempfile
import uuid
import warnings

from portable_fsdp import backends, checkpointing, worker, workdir_lock
from portable_fsdp.accelerate_launch import LaunchSettings
from portable_fsdp.data.loader import check_data
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError
from portable_fsdp.hf_import import xla_settings_onto_spmd_plan
from portable_fsdp.validate import check_backend, resolve_plan


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def preflight(config, backend_name: str, world_size: int, workdir: pathlib.Path, device: str | None = None,
              claim: workdir_lock.Claim | None = None):
    """Every check that can be made without starting a worker. `device`: the device type the run uses, when
    it is not the backend's name (xla: the PJRT device; flax: the JAX platform). `claim`: the workdir's lock,
    taken before anything is written there when this process owns the run."""
    plan = resolve_plan(config, world_size)
    backend = backends.load(backend_name)
    info = backend.describe_model(config)  # the model's family and own settings: capability rules read them
    check_backend(config, plan, backend_name, device or backend_name, world_size, info)
    plan.wrap_classes(info)
    for message in plan.wrap_warnings(info):
        warnings.warn(message, stacklevel=2)
    if config.train.check_fit:  # before anything is written: a run that will not fit is one line
        from portable_fsdp.estimate import check_fit

        check_fit(config, backend_name, world_size, device or backend_name,
                  int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    check_data(config, info.vocab_size)  # and tokenise into the token cache: the workers only map it
    prepare_workdir(workdir, config, backend_name, claim)
    return plan


def prepare_workdir(workdir: pathlib.Path, config, backend_name: str, claim: workdir_lock.Claim | None = None) -> None:
    resume = config.train.resume
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if claim is not None:  # one run per workdir: a live one refuses this start here
            claim.take(workdir)
        probe = workdir / f".write-test-{socket.gethostname()}-{os.getpid()}"  # machines may share it
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError("--workdir", f"{workdir} is not writable ({err.strerror}); choose another directory") from None
    if not resume and (checkpointing.root(workdir) / "latest").exists():
        raise UserError("--workdir", (f"{workdir} already holds checkpoints; pass --config.train.resume=true to "
                                      "continue from them, or choose a new --workdir"))
    if resume and checkpointing.latest(workdir):
        # sizes only: the workers checksum the files, each its share
        checkpointing.check_compatible(checkpointing.verify_sizes(checkpointing.latest(workdir)), config, backend_name)


def start(config, backend_name: str, workdir: pathlib.Path, nproc: int,
          nodes: LaunchSettings | None = None, job: str = "train") -> dict | None:
    """Validate, start the workers and train. `nproc`: this machine's workers; `nodes` (an Accelerate YAML's
    launch keys): the machines they train with and where they meet, one machine when None; `job`: what the
    workers run (worker.JOBS: "train", or "probe" — portable_fsdp.selftest's device measurements). Returns the run's
    summary (the dict `loop.run` returns; rank 0's when this process launched several, None on the other
    machines; None under torch_xla's own launcher, FSDP v1). A run that fails
    prints its `error:` line and raises SystemExit with the exit status (2: a user error, 3: diverged,
    130: interrupted, 1: anything else); a check that fails before any worker starts raises UserError.
    The process that owns the run holds WORKDIR/.lock until it returns (portable_fsdp.workdir_lock)."""
    nodes = nodes or LaunchSettings()
    with workdir_lock.Claim(lambda: owns_workdir(nodes, backend_name)) as claim:
        if backend_name != "xla":  # (xla knows its owner only once its environment is set up)
            claim.check(workdir)  # a live run refuses this start at once; `preflight` takes the lock
        return _start(config, backend_name, workdir, nproc, nodes, functools.partial(preflight, claim=claim), job)


def owns_workdir(nodes: LaunchSettings, backend_name: str) -> bool:
    """Whether this process holds the run's workdir: global rank 0 under torchrun; else machine 0's launcher, or
    on a TPU slice (every host starts the command) worker 0. The workers our launcher starts never take it:
    their launcher holds it for them."""
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    if backend_name == "xla":
        return _tpu_worker() == 0
    return nodes.machine_rank == 0


def _tpu_worker() -> int:
    """This host's worker number in its TPU slice (0 off a TPU), read from the TPU VM's metadata without starting
    torch_xla's runtime. Asked during the checks, once the xla environment is set up."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return 0
    from torch_xla._internal import tpu

    try:
        return tpu.worker_id()
    except Exception:  # no metadata: torch_xla's own start will say what is wrong
        return 0


def _start(config, backend_name: str, workdir: pathlib.Path, nproc: int, nodes: LaunchSettings, checks,
           job: str = "train") -> dict | None:
    if backend_name == "xla":
        xla_settings_onto_spmd_plan(config)  # before the workers get the config
    spec = {"config": config.to_dict(), "backend": backend_name, "workdir": str(workdir), "job": job}
    if backend_name == "flax":
        return _start_jax(config, spec, workdir, nproc, nodes, checks)
    if backend_name == "xla":  # torch_xla: one process per host (SPMD) or its own launcher (FSDP v1)
        from portable_fsdp.backends.xla.launch import start as start_xla

        return start_xla(config, spec, workdir, nproc, checks)
    if under_torchrun():  # every rank checks (cheap, deterministic) before any collective starts
        checks(config, backend_name, int(os.environ["WORLD_SIZE"]), workdir)
        return worker.main(spec)
    checks(config, backend_name, nproc * nodes.num_machines, workdir)
    if nproc == 1 and not nodes.multi_node:
        with _rank_environment(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_rendezvous_port(nodes.main_process_port))):
            return worker.main(spec)
    return _elastic_launch(spec, nproc, nodes)


@contextlib.contextmanager
def _rank_environment(**variables):
    """torchrun's variables for a run in this process, taken back afterwards: a caller of the Python API that
    trains again (another backend, another world size) must not look like a torchrun worker."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start_jax(config, spec: dict, workdir: pathlib.Path, nproc: int, nodes: LaunchSettings, checks) -> dict:
    """JAX: one process drives `nproc` devices (host CPU devices unless JAX_PLATFORMS names others), so no
    launcher; the plan's world size is the device count. Host devices are set up before jax is imported. On
    several machines each machine's launcher is one JAX process (machine_rank of num_machines, meeting at
    main_process_ip:main_process_port) and the world is every machine's devices."""
    if under_torchrun():
        raise UserError("--backend", "flax runs as one process driving every device; start it without torchrun")
    from portable_fsdp.backends.flax.devices import configure_host_devices, join, platform

    configure_host_devices(nproc)
    world_size = nproc * nodes.num_machines
    checks(config, "flax", world_size, workdir, device=platform())
    if nodes.multi_node:
        join(f"{nodes.main_process_ip}:{nodes.main_process_port}", nodes.num_machines, nodes.machine_rank)
    os.environ.update(RANK=str(nodes.machine_rank), WORLD_SIZE=str(world_size))
    return worker.main(spec)


def _rendezvous_port(main_process_port: int | None = None) -> int:
    """The Accelerate YAML's main_process_port, else the user's MASTER_PORT when set (checked to be free, so a
    clash is one clear line, not a hang), else any free port."""
    wanted = main_process_port or os.environ.get("MASTER_PORT")
    name = "main_process_port" if main_process_port else "MASTER_PORT"
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(wanted) if wanted else 0))
        except ValueError:
            raise UserError(name, f"{wanted!r} is not a port number; unset it or give a free port") from None
        except OSError:
            raise UserError(name, f"port {wanted} is already in use; unset {name} to take a free port, or give "
                            "another") from None
        return s.getsockname()[1]


def _rendezvous(nodes: LaunchSettings) -> dict:
    """LaunchConfig's rendezvous fields. One machine: c10d on 127.0.0.1. Several: every machine's launcher meets
    at main_process_ip:main_process_port under one run id; `static` (Accelerate's default) makes machine_rank
    the node rank and machine 0 host the store, `c10d` numbers the nodes as they join."""
    if not nodes.multi_node:
        return dict(min_nodes=1, max_nodes=1, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                    rdzv_endpoint=f"127.0.0.1:{_rendezvous_port(nodes.main_process_port)}")
    if nodes.rdzv_backend == "static" and nodes.machine_rank == 0:
        _rendezvous_port(nodes.main_process_port)  # machine 0 hosts the store: a clash is one line, not a hang
    return dict(min_nodes=nodes.num_machines, max_nodes=nodes.num_machines, rdzv_backend=nodes.rdzv_backend,
                run_id=f"portable_fsdp-{nodes.main_process_port}",
                rdzv_endpoint=f"{nodes.main_process_ip}:{nodes.main_process_port}",
                rdzv_configs={"rank": nodes.machine_rank} if nodes.rdzv_backend == "static" else {})


def _elastic_launch(spec: dict, nproc: int, nodes: LaunchSettings) -> dict | None:
    """Rank 0's summary (the launcher returns {global rank: what worker.main returned} for this machine's
    workers: None on the other machines); SystemExit on a failure."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = {**spec, "launcher_pid": os.getpid()}  # the workers stop if this process dies (worker.main)
    # A failed worker is named once: by its own `error:` line or by `_report_failure`. torch would log its agent's
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
            raise SystemExit(_report_failure(err)) from None
        except SignalException as err:  # the launcher was signalled; the agent has already stopped every worker
            print(f"error: interrupted by {err.sigval.name}; workers stopped", file=sys.stderr)
            raise SystemExit(Interrupted.exit_code) from None


def _message(failure) -> str:
    message = failure.message
    return message.get("message", "") if isinstance(message, dict) else str(message)


def _lost_peer(failure) -> bool:
    text = _message(failure)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def _report_failure(err) -> int:
    """Workers print their own `error:` line for user errors (exit 2); anything else is named here."""
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
