import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_RECIPE = str(ROOT / "portable_fsdp" / "configs" / "llama_tiny.py") + ":test"

# Subprocesses see only the project: no hub, no torch_xla probing, one thread each on 2 cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("USE_TORCH_XLA", "0")
# The token cache (portable_fsdp/data/cache.py) of every test and its subprocesses: out of the user's home, kept
# between sessions (its keys change with the files tokenised).
os.environ.setdefault("PORTABLE_FSDP_DATA_CACHE", os.path.join(tempfile.gettempdir(),
                                                               f"portable_fsdp-test-data-{os.getuid()}"))


def cli(args, cwd, timeout=300, env=None):
    """Run `python -m portable_fsdp.run ARGS` as a user would; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "portable_fsdp.run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def read_metrics(workdir):
    import json

    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture
def test_recipe():
    return TEST_RECIPE
