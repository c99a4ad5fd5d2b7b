"""A workdir in a bucket (portable_fsdp/storage) against the session's S3-compatible server: the commit protocol
(no manifest, no checkpoint; `latest` never names a partial prefix), retries, the lock object."""
import json
import os
import socket
import time

import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.errors import UserError
from portable_fsdp.storage import lock, remote as storage, sync


def committed_locally(workdir, step: int):
    """A small checkpoint committed in `workdir` as a run commits one."""
    staging = checkpointing.prepare_staging(workdir, step)
    (staging / "model.safetensors").write_bytes(bytes([step]) * 1000)
    (staging / "rng").mkdir()
    (staging / "rng" / "rank_00000.pt").write_bytes(b"rng")
    written = {staging / "model.safetensors": None, staging / "rng" / "rank_00000.pt": None}
    checkpointing.write_report(staging, 0, written)
    return checkpointing.commit(workdir, step, {"backend": "cpu"}, keep_last_n=0)


@pytest.fixture
def working_copy(bucket, tmp_path):
    """(the bucket prefix, its local working copy)"""
    url = f"{bucket}/run"
    return storage.open_remote(url), storage.working_copy(url)


def test_a_commit_uploads_the_manifest_last_and_a_resume_downloads_it(working_copy, tmp_path):
    remote, workdir = working_copy
    sync.commit_checkpoint(remote, workdir, committed_locally(workdir, 5), keep_last_n=0)
    sync.commit_checkpoint(remote, workdir, committed_locally(workdir, 10), keep_last_n=0)
    assert sync.committed(remote) == ["step_00000005", "step_00000010"]
    assert [p.name for p in checkpointing.root(workdir).glob("step_*")] == ["step_00000010"]  # one kept here
    elsewhere = tmp_path / "elsewhere"
    assert sync.pull_latest(remote, elsewhere) == "step_00000010"
    assert checkpointing.verify(checkpointing.latest(elsewhere))["step"] == 10


class FailingAt:
    """An fs whose `put_file` of one name fails (a process killed in the middle of an upload)."""

    def __init__(self, fs, name: str):
        self._fs, self._name = fs, name

    def put_file(self, local, path, **kwargs):
        if path.endswith(self._name):
            raise PermissionError("killed here")
        return self._fs.put_file(local, path, **kwargs)

    def __getattr__(self, attribute):
        return getattr(self._fs, attribute)


def test_a_prefix_without_its_manifest_is_never_resumed_nor_named_latest_and_is_removed_by_the_next_commit(
        working_copy, tmp_path):
    remote, workdir = working_copy
    sync.commit_checkpoint(remote, workdir, committed_locally(workdir, 5), keep_last_n=0)
    interrupted = storage.Remote(remote.url, FailingAt(remote.fs, checkpointing.MANIFEST))
    with pytest.raises(PermissionError):
        sync.commit_checkpoint(interrupted, workdir, committed_locally(workdir, 10), keep_last_n=0)
    assert "model.safetensors" in remote.sizes("checkpoints/step_00000010")  # half uploaded
    assert sync.committed(remote) == ["step_00000005"]
    assert remote.read_text("checkpoints/latest").strip() == "step_00000005"
    assert sync.pull_latest(remote, tmp_path / "elsewhere") == "step_00000005"
    sync.commit_checkpoint(remote, workdir, committed_locally(workdir, 15), keep_last_n=0)
    assert remote.children("checkpoints") == ["latest", "step_00000005", "step_00000015"]


def test_latest_naming_a_prefix_without_a_manifest_is_refused_in_one_line(working_copy, tmp_path):
    remote, _ = working_copy
    remote.write_text("checkpoints/step_00000005/model.safetensors", "half")
    remote.write_text("checkpoints/latest", "step_00000005\n")
    with pytest.raises(UserError, match="names step_00000005, which has no manifest.json"):
        sync.pull_latest(remote, tmp_path / "elsewhere")


class Flaky:
    """An fs whose calls fail `failures` times with `error` before they reach the server."""

    def __init__(self, fs, failures: int, error: Exception):
        self._fs, self.failures, self.error, self.calls = fs, failures, error, 0

    def cat_file(self, path, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self._fs.cat_file(path, **kwargs)


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(storage, "RETRY_FIRST_S", 0.001)


@pytest.mark.parametrize("error", [ConnectionResetError("reset by peer"), TimeoutError("read timed out"),
                                   OSError(5, "An error occurred (SlowDown): Please reduce your request rate")])
def test_transient_errors_are_retried_with_backoff(working_copy, fast_backoff, error):
    remote, _ = working_copy
    remote.write_text("note", "kept")
    flaky = Flaky(remote.fs, 3, error)
    assert storage.Remote(remote.url, flaky).read_text("note") == "kept"
    assert flaky.calls == 4


def test_a_lasting_or_permanent_error_is_raised(working_copy, fast_backoff, monkeypatch):
    remote, _ = working_copy
    refused = Flaky(remote.fs, 3, PermissionError("Access Denied"))
    with pytest.raises(PermissionError):
        storage.Remote(remote.url, refused).read_text("note")
    assert refused.calls == 1
    monkeypatch.setattr(storage, "RETRY_TOTAL_S", 0.05)
    down = Flaky(remote.fs, 10**9, ConnectionRefusedError("connection refused"))
    with pytest.raises(ConnectionRefusedError):
        storage.Remote(remote.url, down).read_text("note")
    assert 1 < down.calls < 10**9


def holder(**fields) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "then", "token": "theirs",
                       "refreshed": time.time(), **fields})


@pytest.mark.parametrize("record,live", [
    ({}, True),  # this machine, a live process
    ({"pid": 2**22 + 1}, False),  # this machine, a process that has ended (killed with SIGKILL)
    ({"host": "elsewhere", "pid": 1}, True),  # another machine, refreshed just now
    ({"host": "elsewhere", "pid": 1, "refreshed": 0.0}, False),  # another machine, its heartbeat long stopped
])
def test_the_lock_object_refuses_a_live_run_and_takes_over_a_gone_one(working_copy, capsys, record, live):
    remote, _ = working_copy
    remote.write_text(lock.NAME, holder(**record))
    if live:
        with pytest.raises(UserError, match=r"is in use by a live run \(host .*, pid \d+"):
            lock.acquire(remote)
        return
    taken = lock.acquire(remote)
    assert "taking over" in capsys.readouterr().err
    taken.release()
    assert remote.read_text(lock.NAME) is None


def test_a_released_lock_leaves_a_lock_taken_over_from_it_in_place(working_copy):
    remote, _ = working_copy
    held = lock.acquire(remote)
    remote.write_text(lock.NAME, holder(token="the new holder's"))
    held.release()
    assert json.loads(remote.read_text(lock.NAME))["token"] == "the new holder's"


def test_the_lock_heartbeat_keeps_it_fresh(working_copy):
    remote, _ = working_copy
    held = lock.acquire(remote, heartbeat_s=0.05)
    first = json.loads(remote.read_text(lock.NAME))["refreshed"]
    time.sleep(0.3)
    assert json.loads(remote.read_text(lock.NAME))["refreshed"] > first
    held.release()


def test_a_scheme_without_its_package_names_the_extra(monkeypatch):
    import fsspec

    def missing(*args, **kwargs):
        raise ImportError("No module named 'gcsfs'")

    monkeypatch.setattr(fsspec, "filesystem", missing)
    with pytest.raises(UserError) as raised:
        storage.open_remote("gs://bucket/run")
    assert raised.value.line() == ("error: --workdir: gs:// needs the gcsfs package; pip install "
                                   "'portable_fsdp[cloud]'")
