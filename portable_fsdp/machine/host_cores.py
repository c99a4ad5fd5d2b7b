"""How many of the host's cores this process may use, and each local rank's share of them. Imports no framework.

A rank's CPU work — the optimizer step of offloaded parameters (plan.cpu_offload), the whole step on the cpu
backend, data preparation — runs on its intra-op threads. One thread per rank leaves a GPU node's cores idle while
AdamW crawls; every core per rank oversubscribes them N times. Each local rank takes its share of the cores this
process may run on: its CPU affinity (taskset, SLURM's --cpus-per-task) and a container's CPU quota (cgroup v2
cpu.max, Kubernetes' CPU limit), not the machine's core count.
"""
from __future__ import annotations

import math
import os
import pathlib

CGROUP_CPU_MAX = pathlib.Path("/sys/fs/cgroup/cpu.max")


def available(cpu_max: pathlib.Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its affinity set, capped by the cgroup's quota (rounded up) when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max)
    return max(1, min(cores, quota) if quota else cores)


def _cgroup_quota(cpu_max: pathlib.Path) -> int:
    """cgroup v2's `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none) as whole cores, 0 when unlimited or
    unreadable."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return 0 if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        return 0


def share(local_ranks: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `local_ranks` processes of this host started from this process's cores."""
    return max(1, (available() if cores is None else cores) // max(1, local_ranks))
