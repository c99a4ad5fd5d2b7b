"""The Python API: the pieces `python -m portable_fsdp.run` is made of, for a notebook or a loop of your own.

    import portable_fsdp as pf

    config = pf.get_config("llama_tiny:test", {"train.steps": 5})
    plan = pf.plan_for(config, backend="cpu")  # world size: 1 here, torchrun's under torchrun
    backend = pf.load_backend("cpu")           # a `portable_fsdp.backend.Backend`
    state = pf.init(config, plan, "cpu")       # or with your own parts: model=, loss=, optimizer=, schedule=
    data = pf.Batches(config, backend, state)
    for step in range(config.train.steps):
        state, metrics = backend.train_step(state, data.train(step))
    print(pf.evaluate(backend, state, data.eval))
    pf.save(backend, state, "runs/mine", config, plan)
    backend.finalize(state)

Or the whole run, as the command runs it: `summary = pf.train(config, backend="cpu", workdir="runs/x")`, with the
same parts (`pf.train(config, model=..., loss=..., optimizer=..., schedule=...)`: portable_fsdp/training/parts.py). From a
Hugging Face Trainer's arguments: `config = pf.from_training_arguments(training_args, "llama_tiny")`.
Imports no framework: the backend's is imported by `load_backend`.
"""
from __future__ import annotations

import os
import pathlib

from portable_fsdp import backends

from portable_fsdp.checkpoint import layout as checkpointing, session as checkpoint_session
from portable_fsdp.config.schema import apply_override, command_line_text, load_recipe
from portable_fsdp.config.training_arguments import from_training_arguments
from portable_fsdp.data.loader import open_data
from portable_fsdp.errors import UserError
from portable_fsdp.storage import remote as storage
from portable_fsdp.training.callbacks import EarlyStopping, StopTraining
from portable_fsdp.training.evaluation import evaluate
from portable_fsdp.training.parts import LossInputs, Parts
from portable_fsdp.plan import ShardingPlan
from portable_fsdp.config.validate import check_backend, resolve_plan

__all__ = ["get_config", "from_training_arguments", "plan_for", "load_backend", "init", "Batches", "evaluate", "save",
           "load", "train", "RunFailed", "StopTraining", "EarlyStopping", "LossInputs"]

# What torch's process group reads (env://), for one process when nothing (torchrun, the user) set them.
_SINGLE_PROCESS = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


class RunFailed(Exception):
    """`train` ended without a summary; the run printed why (its `error:` line). `exit_code` as the command's."""

    def __init__(self, exit_code: int):
        self.exit_code = exit_code
        super().__init__(f"the run failed with exit status {exit_code}; its error line is printed above")


def get_config(recipe: str | None = None, overrides: dict | None = None):
    """The locked ConfigDict of `recipe` ("path/to/recipe.py[:arg]" or a bundled name such as "llama_tiny:test";
    None = the default job), with `overrides` as `--config.a.b=value` sets them: {"train.steps": 5, ...}
    (values may be Python values or their command-line text). An unknown field or a wrong type is a UserError."""
    config = load_recipe(recipe)
    for key, value in (overrides or {}).items():
        apply_override(config, key, command_line_text(value))
    return config


def plan_for(config, world_size: int | None = None, backend: str | None = None, model=None) -> ShardingPlan:
    """The validated sharding plan, its mesh sized for `world_size` (default: WORLD_SIZE, else 1). With
    `backend`, also what the command checks before it starts one: a setting that backend refuses is a
    UserError naming the fix, one it ignores a warning (portable_fsdp/capabilities.py); for xla, the
    xla_fsdp_settings that mean a plan field under SPMD FSDPv2 move onto `config`'s plan, as the command does.
    `model`: the model you will pass to `init`, checked in place of the config's."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if backend is not None:
        backends.load(backend).prepare_config(config)
    plan = resolve_plan(config, world)
    if backend is not None:
        module = backends.load(backend)
        info = module.describe_model(config, Parts(model=model))  # the model's family: some rules read it
        check_backend(config, plan, backend, module.device_type(backend), world, info)
    return plan


def load_backend(name: str = backends.DEFAULT):
    """The backend module for `name` (cpu, cuda, xla, flax). Outside torchrun this process becomes rank 0 of 1:
    the environment torch's process group reads is set where unset, so `backend.init` needs no launcher."""
    backends.check_name(name, "backend")
    if "WORLD_SIZE" not in os.environ:
        from portable_fsdp.launch.launcher import rendezvous_port

        os.environ.update({**_SINGLE_PROCESS, "MASTER_PORT": str(rendezvous_port())})
    return backends.load(name)


def init(config, plan: ShardingPlan, backend: str = backends.DEFAULT, *, model=None, loss=None, optimizer=None,
         schedule=None):
    """The backend's first training state: its runtime started, the model built and sharded as `plan` says, the
    optimizer made. Each part given replaces the config's (portable_fsdp/training/parts.py): `model` a torch.nn.Module
    (cpu, cuda, xla) or flax.nnx.Module (flax); `loss(outputs, batch) -> (sum, count)`; `optimizer` a torch
    factory `params -> torch.optim.Optimizer` or an optax transformation; `schedule(step) -> lr`. Then
    `state, metrics = load_backend(backend).train_step(state, micro_batches)`."""
    return load_backend(backend).init(config, plan, backend, Parts(model, loss, optimizer, schedule))


class Batches:
    """This process's batches, as the training loop reads them: `train(step)` -> the micro-batches of optimizer
    step `step` (a list of `data.batch.Batch`, `train.grad_accum_steps` long); `eval` -> the eval batches."""

    def __init__(self, config, backend, state):
        where = backend.placement(state)
        self._train, self.eval = open_data(config, backend.model_info(state).vocab_size, where.dp_rank, where.dp_size)
        self._where = where

    def train(self, step: int) -> list:
        return self._train.micro_batches(step, self._where.dp_rank, self._where.dp_size)


def save(backend, state, workdir, config, plan: ShardingPlan, backend_name: str | None = None,
         keep_last_n: int = 0) -> pathlib.Path:
    """Write a checkpoint of `state` as the loop does (every rank calls it): workdir/checkpoints/step_N, committed
    atomically, `latest` pointing at it (portable_fsdp.checkpoint.session.save). `backend_name`: the name the backend
    was loaded as (default: the module's first name, e.g. cpu for the torch lowering). Returns the checkpoint's
    directory."""
    info = checkpoint_session.manifest_info(config, plan, _name_of(backend, backend_name), backend.placement(state))
    return checkpoint_session.save(backend, state, pathlib.Path(workdir), info, keep_last_n)


def _name_of(backend, backend_name: str | None) -> str:
    """The name the backend module was loaded as (default: its first name, e.g. cpu for the torch lowering)."""
    return backend_name or next(n for n, module in backends.BACKENDS.items() if module == backend.__name__)


def load(backend, state, path, config, backend_name: str | None = None):
    """`state` restored from a checkpoint directory, or from the newest checkpoint of a workdir (checksums
    verified, the model checked to match `config`, a SHARDED checkpoint to be readable by this backend).
    Consumes `state`: use the one returned."""
    path = pathlib.Path(path)
    checkpoint = path if (path / checkpointing.MANIFEST).exists() else checkpointing.latest(path)
    if checkpoint is None:
        raise UserError("load", f"{path} is neither a checkpoint nor a workdir with one")
    return checkpoint_session.resume(backend, state, checkpoint, config, _name_of(backend, backend_name))


def train(config, backend: str = backends.DEFAULT, workdir=None, nproc: int | None = 1, callbacks=(), *, model=None,
          loss=None, optimizer=None, schedule=None) -> dict | None:
    """Train as `python -m portable_fsdp.run` does, with `nproc` local processes (1: in this one; None: the
    command's default), and return the run's summary (what the command prints at the end; rank 0's). `workdir`
    (a directory, or s3://bucket/path or gs://bucket/path) defaults to runs/train-<time>. `callbacks`: objects
    with any of on_step(state, metrics), on_eval(state, metrics), on_save(state, path), called on rank 0; raising
    StopTraining ends the run with a checkpoint (portable_fsdp.training.callbacks; EarlyStopping is one).
    `model`, `loss`, `optimizer`, `schedule`: as `init` takes them, in place of the config's. Raises
    UserError on a bad setting, RunFailed when the run fails after it started."""
    from portable_fsdp.launch import cluster, launcher as launch
    from portable_fsdp.cli import default_workdir

    name = backends.resolve(backend, config)
    nproc = backends.load(name).default_nproc(name) if nproc is None else nproc
    if nproc < 1:
        raise UserError("nproc", f"must be at least 1 (got {nproc})")
    workdir = storage.working_copy(workdir) if storage.is_url(workdir) else \
        pathlib.Path(workdir) if workdir else default_workdir("train")
    try:
        with cluster.rank_environment():  # a run in this process leaves no rank variables behind
            return launch.start(config, name, workdir, nproc, callbacks=callbacks,
                                parts=Parts(model, loss, optimizer, schedule))
    except SystemExit as exit_:
        raise RunFailed(exit_.code if isinstance(exit_.code, int) else 1) from None
