"""What each training process runs, whether started by our launcher, by torchrun, or in this process."""
from __future__ import annotations

import os
import sys

from portable_fsdp import backends

from portable_fsdp.config import schema as config_lib

from portable_fsdp.training import loop
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError, print_notices_as_lines
from portable_fsdp.config.validate import resolve_plan


def _probe(config, plan, backend, backend_name: str, workdir) -> dict:
    from portable_fsdp.selftest import probe

    return probe.run(config, plan, backend, backend_name, workdir)


# What a worker runs: training (the loop), or the self-test's measurements of the devices.
JOBS = {"train": loop.run, "probe": _probe}


def main(spec: dict) -> dict:
    """`spec` = {"config": the config as a plain dict, "backend": "cpu" | "cuda" | ..., "workdir": path, "job": a
    key of JOBS (default "train"), and in this process "callbacks" and "parts" (portable_fsdp.training.parts) for
    the training loop}. Returns the job's summary; the product's errors end the process with one line
    and their exit status.

    Under an elastic agent (our launcher or torchrun, which set TORCHELASTIC_ERROR_FILE) torch's `record`
    writes any other exception to that file, which the agent reads to name the failed rank and its error.
    It is applied here, at call time, so that importing this module imports no framework."""
    print_notices_as_lines()
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(spec)
    return _main(spec)


def _main(spec: dict) -> dict:
    if spec.get("launcher_pid"):
        _die_with_launcher(spec["launcher_pid"])
    config = config_lib.from_dict(spec["config"])
    try:
        plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
        job = JOBS[spec.get("job", "train")]
        extra = {"callbacks": spec["callbacks"]} if spec.get("callbacks") else {}
        if spec.get("parts") and spec["parts"].given():  # only the training loop takes them
            extra["parts"] = spec["parts"]
        return job(config, plan, backends.load(spec["backend"]), spec["backend"], spec["workdir"], **extra)
    except UserError as err:
        print(f"{err.line()} (rank {os.environ.get('RANK', '0')})", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except (TrainingDiverged, Interrupted) as err:  # every rank raises it at the same step: one message
        if os.environ.get("RANK", "0") == "0":
            print(err.line(), file=sys.stderr, flush=True)
        sys.exit(err.exit_code)


def _die_with_launcher(launcher_pid: int) -> None:
    """A worker of our launcher dies with it. torch's spawn sends its workers SIGINT when their parent dies, which
    would have them save a checkpoint (train.save_on_interrupt) after the launcher's workdir lock is gone, racing
    the next run that takes the workdir over; a launcher killed with SIGKILL takes its workers with it instead
    (SIGINT and SIGTERM reach them through the launcher, which waits for their save). Linux only, as torch's."""
    from portable_fsdp.launch.interrupts import die_with_parent

    if os.getppid() != launcher_pid:  # not its child (another start method): nothing to tie
        return
    if not die_with_parent(launcher_pid):  # it died before the signal was armed
        os._exit(1)
