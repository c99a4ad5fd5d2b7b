"""The estimating processes: the framework work runs in workers that import the frameworks (`serve`), one per
environment a backend asks for, so the command imports none and a fake process group never meets a real one. A
`Report` is one estimate's result with the config and target it was made for."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from portable_fsdp import backends
from portable_fsdp.backend import ModelInfo
from portable_fsdp.config.schema import from_dict
from portable_fsdp.errors import UserError
from portable_fsdp.estimate.target import Target
from portable_fsdp.config.validate import resolve_plan


class Estimator:
    """Estimates in worker processes that import the frameworks (`serve`): one for the torch-based backends,
    one per device count for flax (JAX fixes its host-device count when it starts)."""

    def __init__(self):
        self._workers: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process, log in self._workers.values():
            process.stdin.close()
            process.wait(timeout=60)
            log.close()

    def estimate(self, config, target: Target, ranks: list) -> dict:
        """The backend's estimate for `config` on `target` (UserError when the plan does not lower there)."""
        environment = backends.load(target.backend).estimator_environment(target.nproc)
        key = tuple(sorted(environment.items()))  # backends asking for the same environment share a process
        if key not in self._workers:
            self._workers[key] = self._start(environment)
        process, log = self._workers[key]
        request = {"backend": target.backend, "config": config.to_dict(), "world": target.nproc, "ranks": ranks,
                   "device": target.device_type, "host_is_device": target.device == "cpu"}
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            log.seek(0)
            last = (log.read().strip().splitlines() or ["(no output)"])[-1]
            del self._workers[key]
            raise EstimateFailed(f"the estimating process stopped: {last}")
        reply = json.loads(line)
        if "user_error" in reply:
            raise UserError(*reply["user_error"])
        if "error" in reply:
            raise EstimateFailed(reply["error"])
        return reply["result"]

    @staticmethod
    def _start(environment: dict):
        env = {**os.environ, "USE_TORCH_XLA": "0", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1", **environment}
        log = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen([sys.executable, "-c", "from portable_fsdp.estimate.process import serve; serve()"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        return process, log


class EstimateFailed(Exception):
    pass


def serve() -> None:
    """The worker: one JSON request per line on stdin, one JSON reply per line on stdout. Whatever the libraries
    print goes elsewhere (stdout is the replies' channel only)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"result": _estimate_here(request)}
        except UserError as err:
            reply = {"user_error": [err.field, err.message]}
        except Exception as err:  # reported by the parent as the estimate's failure
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _estimate_here(request: dict) -> dict:
    import warnings

    from portable_fsdp.config.validate import check_backend

    backend, world = request["backend"], request["world"]
    config = from_dict(request["config"])
    plan = resolve_plan(config, world)
    module = backends.load(backend)
    info = module.describe_model(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the run itself prints them; here only refusals count
        check_backend(config, plan, backend, request["device"], world, info)
    return module.estimate_memory(request)


@dataclasses.dataclass
class Report:
    config: object
    target: Target
    result: dict

    @property
    def peak(self) -> int:
        return max(rank["peak"] for rank in self.result["ranks"])

    @property
    def model(self) -> ModelInfo:
        """The model the estimate traced, as the backend described it."""
        return ModelInfo(**self.result["model"])

    @property
    def fits(self) -> bool:
        return self.peak <= self.target.usable

    @property
    def state(self) -> int:
        """Parameters and optimizer state a rank holds on its device throughout (0 when offloaded)."""
        rank = self.result["ranks"][0]
        return 0 if rank.get("cpu_offload") else rank["held"]["parameters"] + rank["held"]["optimizer"]
