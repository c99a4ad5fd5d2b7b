"""Machines that share no disk saving into one bucket (portable_fsdp/storage/sync.py), against a bucket kept in a
local directory: each machine's part uploaded with its reports, rank 0's manifest listing every file and uploaded
last, a machine's missing part one line, and a resume that downloads what a local copy lacks."""
import concurrent.futures
import json
import threading
import types

import fsspec
import pytest

from portable_fsdp.backend import Placement
from portable_fsdp.checkpoint import layout as checkpointing, session
from portable_fsdp.errors import UserError
from portable_fsdp.storage import remote as storage, sync

STEP = "step_00000005"
PREFIX = f"checkpoints/{STEP}"


class LocalBucket:
    """A directory as a bucket (where a path needs no parent made), recording the paths it uploads, in order."""

    def __init__(self):
        self._fs, self.uploaded, self.refused = fsspec.filesystem("file"), [], False

    def put_file(self, local, path, **kwargs):
        if self.refused:
            raise PermissionError(f"Access Denied: {path}")
        self.uploaded.append(path)
        self._fs.makedirs(self._fs._parent(path), exist_ok=True)
        return self._fs.put_file(local, path, **kwargs)

    def __getattr__(self, attribute):
        return getattr(self._fs, attribute)


@pytest.fixture
def bucket(tmp_path):
    return storage.Remote(f"file://{tmp_path}/bucket", LocalBucket())


def staged_on_machine(workdir, ranks) -> None:
    """What `ranks` leave in their machine's staging directory of step 5: a shard each, and their reports."""
    staging = checkpointing.staging_dir(workdir, 5)
    (staging / "sharded").mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        shard = staging / "sharded" / f"rank_{rank}.bin"
        shard.write_bytes(bytes([rank]) * 100)
        checkpointing.write_report(staging, rank, {shard: None})


def test_each_machine_uploads_its_part_and_rank_0_lists_every_file_with_the_manifest_last(bucket, tmp_path):
    machine_0, machine_1 = tmp_path / "machine_0", tmp_path / "machine_1"
    staged_on_machine(machine_0, [0, 1])
    staged_on_machine(machine_1, [2, 3])
    staging_1 = checkpointing.staging_dir(machine_1, 5)
    assert sync.machine_ranks(staging_1) == [2, 3]
    sync.upload_machine_share(bucket, staging_1, PREFIX)
    assert sync.committed(bucket) == []  # no manifest yet: never resumed
    elsewhere = sync.gather_reports(bucket, PREFIX, [2, 3])
    final = checkpointing.commit(machine_0, 5, {"backend": "cpu"}, keep_last_n=0, elsewhere=elsewhere)
    assert sorted(checkpointing.read_manifest(final)["files"]) == [f"sharded/rank_{r}.bin" for r in range(4)]
    sync.commit_checkpoint(bucket, machine_0, final, keep_last_n=0, uploaded=frozenset(elsewhere))
    checkpoint_files = [p for p in bucket.fs.uploaded if f"/{STEP}/" in p and "/.reports/" not in p]
    assert checkpoint_files[-1].endswith(f"{STEP}/{checkpointing.MANIFEST}")
    assert sorted(checkpoint_files[:-1]) == [f"{bucket.root}/checkpoints/{STEP}/sharded/rank_{r}.bin"
                                            for r in range(4)]  # each file once: machine 1's by machine 1
    assert sync.committed(bucket) == [STEP]
    assert ".reports" not in bucket.children(f"checkpoints/{STEP}")
    for machine in (machine_0, machine_1):  # both machines resume every rank's files
        assert sync.pull_latest(bucket, machine) == STEP
        assert checkpointing.verify(checkpointing.latest(machine))["step"] == 5


def test_a_machine_whose_part_is_missing_fails_the_save_in_one_line(bucket, tmp_path):
    staged_on_machine(tmp_path / "machine_1", [2])
    sync.upload_machine_share(bucket, checkpointing.staging_dir(tmp_path / "machine_1", 5), PREFIX)
    with pytest.raises(UserError) as raised:
        sync.gather_reports(bucket, PREFIX, [2, 3])
    assert str(raised.value) == (
        f"--workdir: rank(s) [3] did not upload their part of {PREFIX} to {bucket.url}/{PREFIX}/ (their machine's "
        "error says why); check that every machine can write to the bucket")


def test_a_local_copy_holding_the_manifest_but_not_every_file_downloads_the_checkpoint(bucket, tmp_path):
    machine_0 = tmp_path / "machine_0"
    staged_on_machine(machine_0, [0, 1])
    final = checkpointing.commit(machine_0, 5, {"backend": "cpu"}, keep_last_n=0)
    sync.commit_checkpoint(bucket, machine_0, final, keep_last_n=0)
    (final / "sharded" / "rank_1.bin").unlink()  # another machine's file, never here
    assert sync.pull_latest(bucket, machine_0) == STEP
    assert checkpointing.verify(final)["step"] == 5
    assert json.loads((final / checkpointing.MANIFEST).read_text())["files"].keys() == {
        "sharded/rank_0.bin", "sharded/rank_1.bin"}


class Processes:
    """Two processes of one run as threads: each's backend has the collectives save uses (barrier, any_rank)."""

    def __init__(self, count: int):
        self.count, self._barrier, self._flags = count, threading.Barrier(count), [False] * count

    def backend(self, rank: int):
        def any_rank(state, flag):
            self._flags[rank] = flag
            self._barrier.wait(5)
            anyone = any(self._flags)
            self._barrier.wait(5)
            return anyone

        return types.SimpleNamespace(
            placement=lambda state: Placement(rank=rank, world_size=self.count, dp_rank=rank, dp_size=self.count),
            barrier=lambda state, timeout_s=None: self._barrier.wait(timeout_s), any_rank=any_rank,
            model_info=lambda state: types.SimpleNamespace(n_params=1000))


def parts_on_two_machines(tmp_path, refused_on_machine_1: bool) -> list:
    """Rank 0 on machine 0, rank 1 on machine 1, each with its own copy: what `_parts_across_machines` returns or
    raises on each."""
    processes, remotes = Processes(2), [storage.Remote(f"file://{tmp_path}/bucket", LocalBucket()) for _ in "01"]
    remotes[1].fs.refused = refused_on_machine_1

    def process(rank):
        staged_on_machine(tmp_path / f"machine_{rank}", [rank])
        staging = checkpointing.staging_dir(tmp_path / f"machine_{rank}", 5)
        return session._parts_across_machines(processes.backend(rank), None, remotes[rank], staging, PREFIX, 5.0)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(process, rank) for rank in range(2)]
        return [d.exception() or d.result() for d in done]


def test_rank_0_gets_the_other_machines_reports_and_their_files_are_in_the_bucket(tmp_path):
    on_rank_0, on_rank_1 = parts_on_two_machines(tmp_path, refused_on_machine_1=False)
    assert list(on_rank_0) == ["sharded/rank_1.bin"] and on_rank_1 == {}
    assert (tmp_path / "bucket" / PREFIX / "sharded" / "rank_1.bin").read_bytes() == bytes([1]) * 100
    assert not checkpointing.staging_dir(tmp_path / "machine_1", 5).exists()  # the bucket holds its part


def test_a_machine_whose_upload_fails_fails_the_save_on_every_rank_in_one_line(tmp_path):
    on_rank_0, on_rank_1 = parts_on_two_machines(tmp_path, refused_on_machine_1=True)
    assert isinstance(on_rank_0, UserError) and isinstance(on_rank_1, UserError)
    assert str(on_rank_1).startswith(f"--workdir: the machine of rank(s) [1] could not upload its part of {PREFIX} "
                                     f"to file://{tmp_path}/bucket: Access Denied")
    assert str(on_rank_0).startswith(f"--workdir: rank(s) [1] did not upload their part of {PREFIX}")
    assert "\n" not in str(on_rank_0) + str(on_rank_1)
