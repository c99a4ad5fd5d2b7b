"""Running a self-test row and judging it: the backend's run of the feature, the CPU reference it is compared
with (one process, same initial weights and batches: the crosscheck's rule), a resume, an export's weights.
Every run is `python -m portable_fsdp.run` in a process of its own, stopped with its workers after a timeout,
so that a crash or a hang costs one row. Imports no framework."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.config.schema import command_line_text
from portable_fsdp.selftest.features import EXPORT, MODELS, RESUME, STOP, Feature, reference_overrides, run_settings

RUN_TIMEOUT_S = 900  # one run at smoke size: start-up, compilation (torch.compile, XLA) and a few steps


class RunFailed(Exception):
    """A run ended without its losses; the message is its error line."""


@dataclasses.dataclass
class Run:
    workdir: pathlib.Path
    losses: list  # per step, 1..STEPS (a resumed run's last record of a step counts)
    starts: list  # the step each start of the run began at
    tokens_per_sec: float
    seconds: float


def run(backend: str, nproc: int, feature: Feature, workdir: pathlib.Path, weights: pathlib.Path,
        overrides: dict, devices: int, timeout: float = RUN_TIMEOUT_S) -> Run:
    """`python -m portable_fsdp.run` of `feature`'s model on `backend` with `nproc` processes (devices), from
    `weights`, with `overrides` on top of the run settings for `devices` devices."""
    recipe, model_overrides = MODELS[feature.model]
    settings = {**model_overrides, **run_settings(devices), "model.init_from": str(weights), **overrides}
    command = [sys.executable, "-m", "portable_fsdp.run", "--backend", backend, "--nproc", str(nproc),
               "--config", recipe, "--workdir", str(workdir),
               *(f"--config.{key}={command_line_text(value)}" for key, value in settings.items())]
    began = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, env={**os.environ, "USE_TORCH_XLA": "0"}) as process:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and every worker it started
            process.communicate()
            raise RunFailed(f"timed out after {timeout:.0f} s") from None
    if process.returncode != 0:
        raise RunFailed(error_line(stderr, process.returncode))
    return read_run(workdir, time.perf_counter() - began)


def error_line(stderr: str, code: int) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")] or stderr.strip().splitlines()[-1:]
    return lines[-1] if lines else f"exit status {code}"


def read_run(workdir: pathlib.Path, seconds: float) -> Run:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)) or not steps:
        raise RunFailed(f"logged the losses of steps {steps}, not every step from 1")
    rates = [by_step[s]["tokens_per_sec"] for s in steps[1:]] or [by_step[steps[0]]["tokens_per_sec"]]
    return Run(workdir, [by_step[s]["loss"] for s in steps], [r["step"] for r in records if r.get("event") == "start"],
               statistics.median(rates), seconds)


def max_relative_difference(losses: list, reference: list) -> float:
    if len(losses) != len(reference):
        raise RunFailed(f"{len(losses)} losses against the reference's {len(reference)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def resumed(backend: str, nproc: int, feature: Feature, workdir: pathlib.Path, weights: pathlib.Path,
            devices: int) -> Run:
    """The row's run stopped after step STOP (its checkpoint written as the row says), then resumed to the end."""
    run(backend, nproc, feature, workdir, weights, {**feature.overrides, "train.stop_at_step": STOP}, devices)
    second = run(backend, nproc, feature, workdir, weights, {**feature.overrides, "train.resume": True}, devices)
    if second.starts[-1:] != [STOP]:
        raise RunFailed(f"the second start began at step {second.starts[-1:]}, not at the checkpoint of step {STOP}")
    return second


def weights_difference(export: pathlib.Path, checkpoint: pathlib.Path) -> float:
    """The largest relative difference (L2 norm of the difference over the norm of the reference) between a
    tensor of an export and the same tensor of a FULL checkpoint."""
    import numpy as np

    mine, theirs = _tensors(export), _tensors(checkpoint)
    if set(mine) != set(theirs):
        raise RunFailed(f"the export holds {sorted(set(mine) ^ set(theirs))[:3]} where the reference does not")
    return max(float(np.linalg.norm(mine[n] - theirs[n]) / max(np.linalg.norm(theirs[n]), 1e-30)) for n in theirs)


def _tensors(directory: pathlib.Path) -> dict:
    from safetensors.numpy import load_file

    tensors: dict = {}
    for file in sorted(pathlib.Path(directory).glob("*.safetensors")):
        tensors.update({name: value.astype("float64") for name, value in load_file(file).items()})
    return tensors


def latest_checkpoint(workdir: pathlib.Path) -> pathlib.Path:
    latest = checkpointing.latest(workdir)
    if latest is None:
        raise RunFailed(f"{workdir} holds no checkpoint")
    return latest


@dataclasses.dataclass
class References:
    """One CPU process per set of model and training overrides, run once and shared by the rows that need it."""

    root: pathlib.Path
    weights: dict  # model -> its initial weights' directory
    runs: dict = dataclasses.field(default_factory=dict)

    def of(self, feature: Feature, devices: int) -> Run:
        overrides = reference_overrides(feature)
        key = json.dumps([feature.model, overrides], sort_keys=True)
        if key not in self.runs:
            workdir = self.root / f"reference-{len(self.runs)}"
            try:
                self.runs[key] = run("cpu", 1, feature, workdir, self.weights[feature.model], overrides, devices)
            except RunFailed as err:
                self.runs[key] = err
        found = self.runs[key]
        if isinstance(found, RunFailed):
            raise RunFailed(f"the CPU reference failed: {found}")
        return found


def judge(feature: Feature, backend: str, nproc: int, devices: int, root: pathlib.Path,
          references: References) -> dict:
    """Run `feature` and compare it: {"passed", "max_rel_diff", "figure", ...}; RunFailed when a run fails."""
    weights = references.weights[feature.model]
    workdir = root / feature.name
    if feature.kind == RESUME:
        mine = resumed(backend, nproc, feature, workdir, weights, devices)
        figure = f"stopped after step {STOP}, resumed from its checkpoint"
    else:
        mine = run(backend, nproc, feature, workdir, weights, feature.overrides, devices)
        figure = f"{mine.tokens_per_sec:,.0f} tokens/s"
    reference = references.of(feature, devices)
    difference = max_relative_difference(mine.losses, reference.losses)
    result = {"max_rel_diff": difference, "rtol": feature.rtol, "figure": figure,
              "passed": difference <= feature.rtol, "losses": mine.losses, "reference_losses": reference.losses}
    if feature.kind == EXPORT:
        weights_diff = weights_difference(workdir / checkpointing.EXPORT, latest_checkpoint(reference.workdir))
        result.update(weights_max_rel_diff=weights_diff, passed=result["passed"] and weights_diff <= feature.rtol,
                      figure=f"export's weights vs the CPU process's: {weights_diff:.1e}")
    return result
