"""Machines that share no disk saving into one bucket (portable_fsdp/storage/sync.py), against a bucket kept in a
local directory: each machine's part uploaded with its reports, rank 0's manifest listing every file and uploaded
last, a machine's missing part one line, and a resume that downloads what a local copy lacks."""
import json

import fsspec
import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.errors import UserError
from portable_fsdp.storage import remote as storage, sync

STEP = "step_00000005"


class LocalBucket:
    """A directory as a bucket (where a path needs no parent made), recording the paths it uploads, in order."""

    def __init__(self):
        self._fs, self.uploaded = fsspec.filesystem("file"), []

    def put_file(self, local, path, **kwargs):
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
    sync.upload_machine_share(bucket, staging_1, STEP)
    assert sync.committed(bucket) == []  # no manifest yet: never resumed
    elsewhere = sync.gather_reports(bucket, STEP, [2, 3])
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
    sync.upload_machine_share(bucket, checkpointing.staging_dir(tmp_path / "machine_1", 5), STEP)
    with pytest.raises(UserError) as raised:
        sync.gather_reports(bucket, STEP, [2, 3])
    assert str(raised.value) == (
        f"--workdir: rank(s) [3] did not upload their part of {STEP} to {bucket.url}/checkpoints/{STEP}/ (their "
        "machine's error says why); check that every machine can write to the bucket")


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
