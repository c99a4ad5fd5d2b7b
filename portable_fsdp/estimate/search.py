"""The search for settings that fit: changes that lower memory per rank, one group per kind in order of growing
cost, each estimated; the first of a group that fits is reported."""
from __future__ import annotations

import copy
import dataclasses

from portable_fsdp.config.schema import apply_override, from_dict
from portable_fsdp.errors import UserError
from portable_fsdp.estimate.process import Estimator, Report
from portable_fsdp.estimate.target import Target
from portable_fsdp.config.validate import resolve_plan


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A change to try: the command-line words that make it, its world size, the config fields it sets."""

    words: str
    nproc: int
    overrides: tuple = ()


def with_overrides(config, overrides) -> object:
    changed = from_dict(copy.deepcopy(config.to_dict()))
    for key, value in overrides:
        apply_override(changed, key, value)
    return changed


def alternative_groups(config, target: Target) -> list:
    """Changes that lower memory per rank, one group per kind, each in order of growing cost: the first of a
    group that fits is reported. Settings already on, or that the backend cannot lower, are left out."""
    t, p = config.train, config.plan
    groups = [[Alternative(f"--nproc {target.nproc * k}", target.nproc * k) for k in (2, 4, 8)]]
    if not p.activation_checkpointing:
        groups.append([Alternative("--config.plan.activation_checkpointing=true", target.nproc,
                                   (("plan.activation_checkpointing", "true"),))])
    if not p.cpu_offload and target.device != "cpu":  # host memory: no gain (a backend refusing it is skipped)
        groups.append([Alternative("--config.plan.cpu_offload=true", target.nproc, (("plan.cpu_offload", "true"),))])
    accumulation = [t.grad_accum_steps * 2**k for k in range(1, 8)]
    groups.append([Alternative(f"--config.train.grad_accum_steps={a}", target.nproc,
                               (("train.grad_accum_steps", str(a)),)) for a in accumulation])
    for axis in ("tp", "cp"):
        if p[f"{axis}_size"] == 1 and target.nproc > 1:
            groups.append([Alternative(f"--config.plan.{axis}_size={k}", target.nproc, ((f"plan.{axis}_size", str(k)),))
                           for k in (2, 4, 8) if target.nproc % k == 0])
    return [group for group in groups if group]


def one_sequence_per_micro_batch(config, nproc: int) -> tuple:
    """The override that makes each rank's micro-batch one sequence (grad_accum_steps = the batch per
    data-parallel rank), or none when it already is or the mesh does not resolve."""
    try:
        per_rank = config.train.batch_size // resolve_plan(config, nproc).mesh.data_parallel_size
    except UserError:
        return ()
    return (("train.grad_accum_steps", str(per_rank)),) if per_rank > config.train.grad_accum_steps else ()


def combined_alternatives(config, target: Target) -> list:
    """Tried when no single change fits: activation checkpointing with one sequence per micro-batch, then with
    CPU offload too (where the backend offloads), then with more ranks."""
    checkpointing = () if config.plan.activation_checkpointing else (("plan.activation_checkpointing", "true"),)
    settings = checkpointing + one_sequence_per_micro_batch(config, target.nproc)
    combos = [settings] if settings else []
    if target.device != "cpu" and not config.plan.cpu_offload:
        combos.append((*settings, ("plan.cpu_offload", "true")))
    tried = [Alternative(words(c), target.nproc, c) for c in combos]
    for k in (2, 4, 8):
        more = checkpointing + one_sequence_per_micro_batch(config, target.nproc * k)
        tried.append(Alternative(f"--nproc {target.nproc * k} {words(more)}".strip(), target.nproc * k, more))
    return tried


def words(overrides) -> str:
    return " ".join(f"--config.{key}={value}" for key, value in overrides)


def search(estimator: Estimator, report: Report) -> list:
    """[(Alternative, its Report)] of the changes that fit, at most one per group."""
    config, target = report.config, report.target
    found = []

    def fitting(alternative: Alternative):
        changed_target = target.with_nproc(alternative.nproc)
        offloads = any(key == "plan.cpu_offload" for key, _ in alternative.overrides)
        # a lower bound needs no trace: the state alone, spread over more ranks, already too much
        if not offloads and report.state * target.nproc / alternative.nproc * 0.99 > changed_target.usable:
            return None
        try:
            changed = with_overrides(config, alternative.overrides)
            resolve_plan(changed, alternative.nproc)
            result = estimator.estimate(changed, changed_target, [0])
        except UserError:
            return None  # the change does not lower there (batch does not split, heads do not divide, ...)
        candidate = Report(changed, changed_target, result)
        return candidate if candidate.fits else None

    for group in alternative_groups(config, target):
        for alternative in group:
            candidate = fitting(alternative)
            if candidate:
                found.append((alternative, candidate))
                break
    if not found:
        for alternative in combined_alternatives(config, target):
            candidate = fitting(alternative)
            if candidate:
                found.append((alternative, candidate))
                break
    return found
