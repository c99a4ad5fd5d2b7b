"""Running the CLI as a user would and reading back its metrics, for the benchmark scripts."""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_cli(args: list, nproc: int, timeout: int = 900) -> list:
    """Run `python -m portable_fsdp.run` in a fresh workdir; returns its metrics records (raises on failure)."""
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run([sys.executable, "-m", "portable_fsdp.run", "--workdir", workdir, "--nproc", str(nproc),
                               "--config.train.progress_bar=false", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "USE_TORCH_XLA": "0"})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
        return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


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
