"""What the host process holds, read the same way by every backend's memory report (psutil and /proc only)."""
from __future__ import annotations

import resource

import psutil


def resident_mb() -> float:
    """This process's resident set now, in MiB."""
    return psutil.Process().memory_info().rss / 2**20


def peak_resident_mb() -> float:
    """The largest resident set this process has had, in MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def shared_resident_mb() -> float:
    """Resident shared memory of this process (RssShmem in /proc/self/status), in MiB: buffers mapped by several
    processes (the CPU collectives'), counted in each one's resident set but held once. 0 where unknown."""
    try:
        with open("/proc/self/status") as status:
            line = next((line for line in status if line.startswith("RssShmem:")), None)
    except OSError:
        return 0.0
    return int(line.split()[1]) / 2**10 if line else 0.0
