"""Entry points: the estimate of a config on a target, and train.check_fit, which refuses at start-up a run that will
not fit, naming settings that would."""
from __future__ import annotations

import dataclasses

from portable_fsdp.errors import UserError
from portable_fsdp.estimate.process import EstimateFailed, Estimator, Report
from portable_fsdp.estimate.report import verdict
from portable_fsdp.estimate.search import search
from portable_fsdp.estimate.target import Target, resolve_target, tpu_from_environment
from portable_fsdp.config.validate import resolve_plan


def estimate_config(config, target: Target, ranks: list | None = None, estimator: Estimator | None = None) -> Report:
    """The estimate of `config` on `target`: ranks 0 and the last by default."""
    resolve_plan(config, target.nproc)  # a bad mesh or batch is one line before any process starts
    ranks = ranks if ranks is not None else sorted({0, target.nproc - 1})
    if estimator is not None:
        return Report(config, target, estimator.estimate(config, target, ranks))
    with Estimator() as own:
        return Report(config, target, own.estimate(config, target, ranks))


def check_fit(config, backend: str, world_size: int, device: str, local_ranks: int | None = None) -> None:
    """train.check_fit at start-up: a UserError naming settings that fit when the run's peak per rank exceeds its
    device's usable memory. `device`: the device type the run uses (cuda, cpu, TPU, ...)."""
    target = resolve_target(backend, fit_device(device), local_ranks or world_size)
    target = dataclasses.replace(target, nproc=world_size)
    try:
        with Estimator() as estimator:
            report = estimate_config(config, target, [0], estimator)
            if report.fits:
                return
            line = verdict(report, search(estimator, report))
    except EstimateFailed as err:
        raise UserError("train.check_fit", f"the memory estimate failed ({err}); set it to false to start anyway")
    raise UserError("train.check_fit", line + "; set train.check_fit=false to start anyway")


def fit_device(device: str) -> str:
    """The estimate's device for a run on `device` (as its framework names it: cuda, gpu, cpu, TPU, ...): the
    visible GPU (torch's cuda, JAX's gpu), this TPU VM's chips, or host memory."""
    device = device.lower()
    if device in ("cuda", "gpu"):
        return "detected"
    if device == "tpu":
        name = tpu_from_environment()
        if not name:
            raise UserError("train.check_fit", "cannot tell which TPU this is: set TPU_ACCELERATOR_TYPE (e.g. v5p-8), "
                            "or check beforehand with python -m portable_fsdp.estimate --device v5p")
        return name
    if device == "cpu":
        return "cpu"
    raise UserError("train.check_fit", f"knows no memory size for {device} devices; set it to false, or check "
                    "with python -m portable_fsdp.estimate --device NAME")
