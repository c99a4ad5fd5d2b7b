"""Start a run: validate everything that can be checked before a worker starts (so a bad config costs seconds
and prints one line), hold the workdir, and hand the workers' start to the backend (`Backend.start_workers`: torch's
elastic launcher for cpu/cuda, one SPMD process or torch_xla's launcher for xla, one JAX process for flax)."""
from __future__ import annotations

import os
import pathlib
import socket

from portable_fsdp import backends

from portable_fsdp.checkpoint import layout as checkpointing

from portable_fsdp.launch import cluster, shared_workdir, workdir_lock
from portable_fsdp.storage import lock as bucket_lock, remote as storage, sync
from portable_fsdp.config.accelerate import LaunchSettings
from portable_fsdp.data.loader import check_data
from portable_fsdp.errors import UserError, notify
from portable_fsdp.machine import tpu_vm
from portable_fsdp.config.validate import check_backend, resolve_plan
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts


def under_torchrun() -> bool:
    return cluster.under_torchrun(os.environ)


def preflight(config, backend_name: str, world_size: int, workdir: pathlib.Path, device: str | None = None,
              claim: workdir_lock.Claim | None = None, parts: Parts = NO_PARTS, lowering_checks=None):
    """Every check that can be made without starting a worker. `device`: the device type the run uses, when
    it is not the backend's name (xla: the PJRT device; flax: the JAX platform). `claim`: the workdir's lock,
    taken before anything is written there when this process owns the run. `parts`: the model, loss, optimizer
    and schedule a caller of `portable_fsdp.train` brought (their model is the one checked). `lowering_checks`:
    a lowering's own checks of the resolved plan, `(plan) -> None`, run once the shared ones pass."""
    plan = resolve_plan(config, world_size)
    backend = backends.load(backend_name)
    info = backend.describe_model(config, parts)  # the model's family and own settings: capability rules read them
    check_backend(config, plan, backend_name, device or backend_name, world_size, info)
    if lowering_checks is not None:
        lowering_checks(plan)
    plan.wrap_classes(info)
    for message in plan.wrap_warnings(info):
        notify(message)
    if config.train.check_fit and parts.model is not None:
        notify("train.check_fit estimates the config's model, not one passed in: skipped")
    elif config.train.check_fit:  # before anything is written: a run that will not fit is one line
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
    remote = storage.of(workdir)
    if remote is not None:  # the bucket is the workdir: its lock, its checkpoints (portable_fsdp/storage/sync.py)
        if claim is not None and claim.lock is not None:
            claim.hold(bucket_lock.acquire(remote))
        sync.prepare(remote, workdir, resume)
    if not resume and (checkpointing.root(workdir) / "latest").exists():
        raise UserError("--workdir", (f"{workdir} already holds checkpoints; pass --config.train.resume=true to "
                                      "continue from them, or choose a new --workdir"))
    if resume and checkpointing.latest(workdir):
        # sizes only: the workers checksum the files, each its share
        checkpointing.check_compatible(checkpointing.verify_sizes(checkpointing.latest(workdir)), config, backend_name)


def start(config, backend_name: str, workdir: pathlib.Path, nproc: int,
          nodes: LaunchSettings | None = None, job: str = "train", callbacks=(), parts: Parts = NO_PARTS) -> dict | None:
    """Validate, start the workers and train. `nproc`: this machine's workers; `nodes` (an Accelerate YAML's
    launch keys): the machines they train with and where they meet, one machine when None; `job`: what the
    workers run (worker.JOBS: "train", or "probe" — portable_fsdp.selftest's device measurements); `callbacks`: the
    training loop's (portable_fsdp.training.callbacks), for workers in this process; `parts`: the model, loss,
    optimizer and schedule brought in place of the config's (portable_fsdp.training.parts), for them too. Returns the run's
    summary (the dict `loop.run` returns; rank 0's when this process launched several, None on the other
    machines; None under torch_xla's own launcher, FSDP v1). A run that fails
    prints its `error:` line and raises SystemExit with the exit status (2: a user error, 3: diverged,
    130: interrupted, 1: anything else); a check that fails before any worker starts raises UserError.
    The process that owns the run holds WORKDIR/.lock until it returns (portable_fsdp.launch.workdir_lock)."""
    nodes = nodes or LaunchSettings()
    several_machines = nodes.multi_node or tpu_vm.slice_workers()[1] > 1  # a file's machines, or a slice's hosts
    if several_machines and storage.of(workdir) is None:  # a bucket's working copy is local by design
        shared_workdir.warn_if_local(workdir)
    with workdir_lock.Claim(lambda: owns_workdir(nodes, backend_name)) as claim:
        claim.check(workdir)  # a live run refuses this start at once; `preflight` takes the lock
        backend = backends.load(backend_name)
        backend.prepare_config(config)  # before the workers get the config
        spec = {"config": config.to_dict(), "backend": backend_name, "workdir": str(workdir), "job": job,
                "callbacks": list(callbacks), "parts": parts}

        def checks(*args, **kwargs):
            plan = preflight(*args, claim=claim, parts=parts, **kwargs)
            spec["config"] = config.to_dict()  # train.steps and data.tokenizer as the checks resolved them
            return plan

        try:
            return backend.start_workers(config, spec, workdir, nproc, nodes, checks)
        finally:
            remote = storage.of(workdir)
            if remote is not None and claim.lock is not None:  # the run's records, however it ended
                sync.push_records(remote, workdir)


def owns_workdir(nodes: LaunchSettings, backend_name: str) -> bool | None:
    """Whether this process holds the run's workdir (the backend's answer: global rank 0 under torchrun, machine
    0's launcher, a TPU slice's worker 0); None while the backend cannot tell yet. The workers our launcher starts
    never take it: their launcher holds it for them."""
    return backends.load(backend_name).owns_workdir(nodes)


def rendezvous_port(main_process_port: int | None = None) -> int:
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
