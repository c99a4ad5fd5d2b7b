"""Running the CLI as a user would and reading back its metrics, for the benchmark scripts."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import signal
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The `--config.a.b=value` overrides of a benchmark's command line, for every run it makes (its worker
# subprocesses inherit them through the environment).
OVERRIDES_ENV = "PORTABLE_FSDP_BENCHMARK_OVERRIDES"


def parse_benchmark_args(parser, argv=None):
    """The benchmark's own flags; every other argument must be a `--config.a.b=value` override, as
    `python -m portable_fsdp.run` takes it, and then applies to every run of the benchmark (checked here, so a
    bad one is the CLI's one-line error before anything runs)."""
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.errors import UserError
    from portable_fsdp.cli import config_overrides

    args, rest = parser.parse_known_args(argv)
    try:
        overrides = config_overrides(rest)
        for key, value in overrides:
            apply_override(load_recipe(None), key, value)
    except UserError as err:
        sys.exit(err.line())
    os.environ[OVERRIDES_ENV] = json.dumps([f"--config.{key}={value}" for key, value in overrides])
    return args


def user_overrides() -> list:
    return json.loads(os.environ.get(OVERRIDES_ENV, "[]"))


# A tiny Llama for smoke runs: checks that a benchmark works, measures nothing.
TINY_MODEL = ["--config.model.hidden_size=64", "--config.model.intermediate_size=160",
              "--config.model.num_hidden_layers=2", "--config.model.num_attention_heads=4",
              "--config.model.num_key_value_heads=2"]


def config_from_flags(flags: list):
    """The config `python -m portable_fsdp.run FLAGS` would run, parsed by the CLI's own code (a bad flag is
    the CLI's one-line UserError)."""
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.run import parse_args as parse_run_args

    config = load_recipe(None)
    for key, value in parse_run_args([*flags, *user_overrides()])[1]:
        apply_override(config, key, value)
    return config


def fsdp_prefetch(flags: list, nproc: int, backend: str) -> str:
    """Whether a run of `flags` on `nproc` ranks has its FSDP layers prefetch each other's all-gathers, as the
    torch lowering decides it: "on", "off", or "no FSDP" (one rank trains the plain module)."""
    from portable_fsdp.backends.torch.parallelize import explicit_prefetch, shards
    from portable_fsdp.config.validate import plan_from_config

    plan = plan_from_config(config_from_flags(flags))
    if not shards(plan, nproc, backend):
        return "no FSDP"
    return "on" if explicit_prefetch(plan, backend) else "off"


def run_python(args: list, timeout: float, env: dict | None = None, python: str | None = None,
               cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """`python ARGS` (this interpreter unless another venv's `python` is given) from the repo root. On a timeout (or
    Ctrl-C) its whole process group is killed: the workers our launcher starts are grandchildren, which killing the
    launcher alone would leave running."""
    with subprocess.Popen([python or sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, env={**os.environ, "USE_TORCH_XLA": "0", **(env or {})}) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):  # the group may have ended by itself meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(args: list, nproc: int, timeout: float = 900, env: dict | None = None, python: str | None = None) -> list:
    """Run `python -m portable_fsdp.run` (this repository's package, with `python`'s libraries) in a fresh workdir;
    returns its metrics records (raises on failure)."""
    with tempfile.TemporaryDirectory() as workdir:
        proc = run_python(["-m", "portable_fsdp.run", "--workdir", workdir, "--nproc", str(nproc),
                           "--config.train.progress_bar=false", *args, *user_overrides()], timeout, env, python)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
        return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, module_args: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` of a benchmark worker module; raises with the worker's error line. Its
    agent's files go to a temporary directory removed after it (by default torchrun leaves one per run)."""
    with tempfile.TemporaryDirectory(prefix="torchrun-") as agent_files:
        proc = run_python(["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                           str(free_port()), "--log-dir", agent_files, "-m", *module_args], timeout, env)
    if proc.returncode != 0:
        raise RuntimeError(error_line(proc.stderr))
    return proc


def attempt(measure, *args) -> dict:
    """One sub-run; its failure becomes that row's one-line error, not the end of the benchmark."""
    try:
        return measure(*args)
    except subprocess.TimeoutExpired as err:
        return {"error": f"timed out after {err.timeout:.0f} s"}
    except (RuntimeError, TimeoutError) as err:
        return {"error": str(err)}


def error_line(stderr: str) -> str:
    """A worker's exception line: torchrun ends stderr with its own failure summary, which names none."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ("Error" in line.split(":")[0] or "Exception" in line.split(":")[0])
              and "ChildFailedError" not in line]
    return (errors or lines or ["failed"])[-1]


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def table(headers: list, rows: list) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
