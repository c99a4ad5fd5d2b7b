"""Fault injection for the reliability tests: `PORTABLE_FSDP_FAULTS="kill@save.written:rank=1,nan@step=4"`.

Each fault is `action@point[:rank=R][:step=S]`; actions: kill (SIGKILL itself), raise (RuntimeError),
nan (the backend poisons that step's loss). Unset in normal runs, where every check is one dict lookup.
"""
from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("PORTABLE_FSDP_FAULTS", "")


def _parse(spec: str) -> list:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        action, _, rest = item.partition("@")
        point, *conditions = rest.split(":")
        fields = dict(condition.split("=", 1) for condition in conditions)
        faults.append((action, point, int(fields.get("rank", -1)), int(fields.get("step", -1))))
    return faults


_FAULTS = _parse(_SPEC)


def _matches(action: str, point: str, rank: int, step: int) -> bool:
    return any(a == action and p == point and r in (-1, rank) and s in (-1, step) for a, p, r, s in _FAULTS)


def check(point: str, rank: int, step: int) -> None:
    """Die or raise here if a test asked for it."""
    if not _FAULTS:
        return
    if _matches("kill", point, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _matches("raise", point, rank, step):
        raise RuntimeError(f"injected fault at {point} (rank {rank}, step {step})")


def poison_loss(rank: int, step: int) -> bool:
    return bool(_FAULTS) and _matches("nan", "step", rank, step)
