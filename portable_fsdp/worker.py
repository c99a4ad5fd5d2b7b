"""What each training process runs, whether started by our launcher or by torchrun."""
from __future__ import annotations

import os
import sys

import ml_collections
from torch.distributed.elastic.multiprocessing.errors import record

from portable_fsdp import backends, loop
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError
from portable_fsdp.validate import resolve_plan


@record
def main(spec: dict) -> dict:
    """`spec` = {"config": the config as a plain dict, "backend": "cpu" | "cuda", "workdir": path}."""
    config = ml_collections.ConfigDict(spec["config"])
    try:
        plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
        return loop.run(config, plan, backends.load(spec["backend"]), spec["backend"], spec["workdir"])
    except UserError as err:
        print(f"{err.line()} (rank {os.environ.get('RANK', '0')})", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except (TrainingDiverged, Interrupted) as err:  # every rank raises it at the same step: one message
        if os.environ.get("RANK", "0") == "0":
            print(err.line(), file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
