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


@pytest.fixture(autouse=True, scope="module")
def rank_environment_per_file():
    """torchrun's variables as each test file found them: `portable_fsdp.load_backend` makes its process rank 0 of 1
    for good, and a file's leftovers would make the next file's process look like one rank of a run."""
    from portable_fsdp.launch.cluster import rank_environment

    with rank_environment():
        yield


@pytest.fixture
def test_recipe():
    return TEST_RECIPE


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto's) on a free local port for the whole session, reached as a user reaches
    one: through AWS_ENDPOINT_URL and the credentials variables, which the runs' subprocesses inherit."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield settings["AWS_ENDPOINT_URL"]
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


@pytest.fixture
def bucket(s3_server, tmp_path, monkeypatch):
    """A new, empty bucket on the session's server: its s3:// URL. Local working copies go under this test's
    tmp_path."""
    import uuid

    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    monkeypatch.setenv("PORTABLE_FSDP_LOCAL_WORKDIRS", str(tmp_path / "local"))
    return f"s3://{name}"
