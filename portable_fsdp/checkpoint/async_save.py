"""train.async_save: a SHARDED checkpoint written in the background while training goes on.

The backend copies the state before returning (cpu/cuda: into shared host memory, written by the rank's writer
process, portable_fsdp/backends/torch/save_process.py) and hands back a future of its write. A thread per rank waits for it and leaves the rank's report
(checkpointing.write_report); on rank 0 the same thread then waits for every rank's report in the staging
directory and commits (manifest, rename, `latest`, pruning). No collective runs there: the training thread keeps
the process group to itself. At most one save is in flight: the next save, the end of the run and any stop wait
for it first (`finish`), so a run never ends, and no staging directory is cleared, before its checkpoint is
committed. Imports no framework.
"""
from __future__ import annotations

import pathlib
import threading

from portable_fsdp.checkpoint import layout as checkpointing

from portable_fsdp.training import faults

_in_flight: list = []  # (thread, errors) of the save being finished in the background


def start(write, staging: pathlib.Path, rank: int, step: int, written: dict, processes: int, timeout_s: float,
          commit=None) -> None:
    """`write`: a future of {path: digest or None} (this rank's files); `written`: what was written beside it
    synchronously; `commit`: rank 0's commit, run once all `processes` ranks have reported (within `timeout_s`)."""
    errors: list = []

    def finish_in_background() -> None:
        try:
            checkpointing.write_report(staging, rank, {**written, **write.result()})
            faults.check("save.written", rank, step)
            if commit is not None:
                checkpointing.wait_for_reports(staging, processes, timeout_s)
                commit()
        except BaseException as err:  # raised in the training thread by `finish`
            errors.append(err)

    thread = threading.Thread(target=finish_in_background, name=f"portable_fsdp-save-{step}", daemon=True)
    thread.start()
    _in_flight.append((thread, errors))


def in_background(work, name: str) -> None:
    """Run `work()` in a thread that `finish` waits for (a workdir in a bucket: rank 0's upload of a committed
    checkpoint, so the training steps go on while it uploads)."""
    errors: list = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # raised in the training thread by `finish`
            errors.append(err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    _in_flight.append((thread, errors))


def finish() -> None:
    """Wait until the save in flight (if any) is written on this rank and, on rank 0, committed (and uploaded);
    its error, if it had one, is raised here."""
    while _in_flight:
        thread, errors = _in_flight.pop(0)
        thread.join()
        if errors:
            raise errors[0]
