"""The shared checkpoint layout and atomic commit (portable_fsdp/checkpoint/layout.py)."""
import json
import os

import pytest
import xxhash

from portable_fsdp.checkpoint import checksums, layout as ckpt
from tests.unit._helpers import user_error


def save(workdir, step, files=None, keep_last_n=3, info=None):
    """Stage `files` ({relative path: bytes}) for `step` and commit it, as rank 0 does."""
    staging = ckpt.prepare_staging(workdir, step)
    for rel, data in (files if files is not None else {"model.safetensors": f"weights {step}".encode()}).items():
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return ckpt.commit(workdir, step, info or {"backend": "cpu"}, keep_last_n)


def step_dirs(workdir):
    return sorted(p.name for p in ckpt.root(workdir).iterdir() if p.is_dir())


def test_prepare_staging_gives_an_empty_hidden_dir(tmp_path):
    staging = ckpt.prepare_staging(tmp_path, 7)
    assert staging == tmp_path / "checkpoints" / ".tmp-step_00000007"
    assert staging.is_dir() and not any(staging.iterdir())
    assert staging == ckpt.staging_dir(tmp_path, 7)


def test_leftover_staging_dir_is_discarded(tmp_path):
    staging = ckpt.prepare_staging(tmp_path, 5)
    (staging / "half_written.bin").write_bytes(b"crash")
    (staging / "sub").mkdir()
    (staging / "sub" / "x").write_bytes(b"y")
    again = ckpt.prepare_staging(tmp_path, 5)
    assert again == staging and not any(again.iterdir())


def test_commit_writes_step_dir_and_manifest(tmp_path):
    files = {"model.safetensors": b"\x00" * 1000, "optim/rank_0.pt": b"abc", "optim/rank_1.pt": b""}
    final = save(tmp_path, 12, files, info={"backend": "cpu", "world_size": 2})
    assert final == tmp_path / "checkpoints" / "step_00000012"
    assert not ckpt.staging_dir(tmp_path, 12).exists()
    manifest = ckpt.read_manifest(final)
    assert manifest == json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["backend"] == "cpu" and manifest["world_size"] == 2
    assert set(manifest["files"]) == set(files)
    for rel, data in files.items():
        entry = manifest["files"][rel]
        assert entry == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
        assert (final / rel).read_bytes() == data
    assert "manifest.json" not in manifest["files"]


def test_latest_pointer_names_newest(tmp_path):
    assert ckpt.latest(tmp_path) is None
    save(tmp_path, 1)
    assert ckpt.latest(tmp_path) == ckpt.root(tmp_path) / "step_00000001"
    save(tmp_path, 2)
    assert (ckpt.root(tmp_path) / "latest").read_text() == "step_00000002\n"
    assert ckpt.latest(tmp_path) == ckpt.root(tmp_path) / "step_00000002"
    assert not (ckpt.root(tmp_path) / "latest.tmp").exists()


def test_latest_pointer_replaced_atomically(tmp_path, monkeypatch):
    save(tmp_path, 1)
    pointer = ckpt.root(tmp_path) / "latest"
    calls = []
    real_replace = os.replace

    def watching_replace(src, dst):
        # Just before the swap the old pointer is intact and the new one is complete beside it.
        calls.append((str(src), str(dst), pointer.read_text(), open(src).read()))
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", watching_replace)
    save(tmp_path, 2)
    assert calls == [(str(pointer.with_suffix(".tmp")), str(pointer), "step_00000001\n", "step_00000002\n")]


def test_crash_before_commit_leaves_previous_checkpoint(tmp_path):
    save(tmp_path, 1)
    staging = ckpt.prepare_staging(tmp_path, 2)
    (staging / "model.safetensors").write_bytes(b"partial")
    assert ckpt.latest(tmp_path) == ckpt.root(tmp_path) / "step_00000001"
    save(tmp_path, 2)
    assert ckpt.latest(tmp_path).name == "step_00000002"


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_n(tmp_path, keep):
    for step in (10, 20, 30, 40):
        save(tmp_path, step, keep_last_n=keep)
    expected = [f"step_{s:08d}" for s in (10, 20, 30, 40)][-keep:]
    assert step_dirs(tmp_path) == expected
    assert ckpt.latest(tmp_path).name == "step_00000040"


def test_prune_orders_by_step_not_by_save_order(tmp_path):
    for step in (9, 100, 1000):
        save(tmp_path, step, keep_last_n=2)
    assert step_dirs(tmp_path) == ["step_00000100", "step_00001000"]


def test_prune_ignores_incomplete_dirs_and_staging_discards_stale_saves(tmp_path):
    incomplete = ckpt.root(tmp_path) / "step_00000001"
    incomplete.mkdir(parents=True)
    (incomplete / "model.safetensors").write_bytes(b"x")
    stale = ckpt.prepare_staging(tmp_path, 3)  # a save that crashed before its commit
    for step in (2, 4, 6):
        save(tmp_path, step, keep_last_n=1)
    assert incomplete.is_dir()  # not a complete checkpoint: not counted, not removed
    assert not stale.exists()  # the next save clears leftovers of crashed ones
    assert step_dirs(tmp_path) == ["step_00000001", "step_00000006"]


def test_commit_same_step_again_keeps_the_complete_one(tmp_path):
    """A valid checkpoint is never deleted to make room for a second save of the same step."""
    save(tmp_path, 5, {"a.bin": b"old", "more.bin": b"s"})
    final = save(tmp_path, 5, {"a.bin": b"new"})
    assert (final / "a.bin").read_bytes() == b"old"
    assert set(ckpt.read_manifest(final)["files"]) == {"a.bin", "more.bin"}
    assert not ckpt.staging_dir(tmp_path, 5).exists()


def test_verify_detects_truncation_missing_files_and_bad_manifests(tmp_path):
    final = save(tmp_path, 7, {"model.safetensors": b"x" * 100, "optimizer.pt": b"y" * 10})
    assert ckpt.verify(final)["step"] == 7
    (final / "model.safetensors").write_bytes(b"x" * 50)
    with user_error("train.resume", "does not match its checksum"):
        ckpt.verify(final)
    (final / "model.safetensors").write_bytes(b"z" * 100)  # same size, other bytes
    with user_error("train.resume", "does not match its checksum"):
        ckpt.verify(final)
    (final / "optimizer.pt").unlink()
    (final / "model.safetensors").write_bytes(b"x" * 100)
    with user_error("train.resume", "is missing; the checkpoint is incomplete"):
        ckpt.verify(final)
    (final / "manifest.json").write_text("{not json")
    with user_error("train.resume", "missing or unreadable"):
        ckpt.verify(final)


def test_check_compatible_refuses_another_model_shape():
    from portable_fsdp.config.schema import base_config

    config = base_config()
    manifest = {"config": {"model": {**config.model.to_dict(), "hidden_size": 256}}}
    with user_error("train.resume", "model.hidden_size 256 -> 128"):
        ckpt.check_compatible(manifest, config, "cpu")
    ckpt.check_compatible({"config": {"model": config.model.to_dict()}}, config, "cpu")


@pytest.mark.parametrize("written_by, resumed_by, readable", [
    ("cpu", "cuda", True), ("cuda", "cpu", True), ("xla", "xla", True),
    ("cpu", "xla", False), ("xla", "cpu", False), ("xla", "flax", False), ("cpu", "flax", False),
])
def test_a_sharded_checkpoint_resumes_where_its_format_is_read(written_by, resumed_by, readable):
    from portable_fsdp.config.schema import base_config

    config = base_config()
    manifest = {"backend": written_by, "state_dict_type": "SHARDED_STATE_DICT",
                "config": {"model": config.model.to_dict()}}
    if readable:
        ckpt.check_compatible(manifest, config, resumed_by)
    else:
        with user_error("train.resume", f"SHARDED_STATE_DICT of --backend {written_by}, which --backend "
                                        f"{resumed_by} cannot read; resume it with --backend {written_by}"):
            ckpt.check_compatible(manifest, config, resumed_by)
    # FULL checkpoints resume everywhere
    ckpt.check_compatible({**manifest, "state_dict_type": "FULL_STATE_DICT"}, config, resumed_by)


def test_the_layout_is_read_from_the_directory(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / ckpt.WEIGHTS).write_bytes(b"")
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "model-00001-of-00002.safetensors").write_bytes(b"")
    (tmp_path / "sharded" / ckpt.SHARDED).mkdir(parents=True)
    assert ckpt.stored_layout(tmp_path / "full") == ckpt.stored_layout(tmp_path / "split") == "FULL_STATE_DICT"
    assert ckpt.stored_layout(tmp_path / "sharded") == "SHARDED_STATE_DICT"
    (tmp_path / "empty").mkdir()
    with user_error("train.resume", "holds neither model.safetensors nor sharded/; it is not a checkpoint"):
        ckpt.stored_layout(tmp_path / "empty")


def test_latest_pointing_to_dir_without_manifest(tmp_path):
    save(tmp_path, 1)
    broken = ckpt.root(tmp_path) / "step_00000009"
    broken.mkdir()
    (ckpt.root(tmp_path) / "latest").write_text("step_00000009\n")
    with user_error("train.resume", "names step_00000009, which has no manifest.json"):
        ckpt.latest(tmp_path)


def test_latest_pointing_to_missing_dir(tmp_path):
    ckpt.root(tmp_path).mkdir(parents=True)
    (ckpt.root(tmp_path) / "latest").write_text("step_00000003")
    with user_error("train.resume", "which has no manifest.json"):
        ckpt.latest(tmp_path)


def test_latest_without_checkpoints_dir(tmp_path):
    assert ckpt.latest(tmp_path / "never_used") is None


# ------------------------------------------------- checksums by the ranks that write, checks shared on resume

def test_ranks_report_their_own_checksums_and_the_commit_gathers_them(tmp_path, monkeypatch):
    staging = ckpt.prepare_staging(tmp_path, 3)
    files = {0: {"model-00001-of-00002.safetensors": b"a" * 64, "rng/rank_00000.pt": b"r0"},
             1: {"model-00002-of-00002.safetensors": b"b" * 32, "rng/rank_00001.pt": b"r1"}}
    for rank, mine in files.items():
        written = {}
        for rel, data in mine.items():
            (staging / rel).parent.mkdir(exist_ok=True)
            (staging / rel).write_bytes(data)
            written[staging / rel] = None
        ckpt.write_report(staging, rank, written)
    (staging / "config.json").write_text("{}")  # written by rank 0 but not reported: checksummed at the commit
    hashed = []
    real = checksums.of_file
    monkeypatch.setattr(checksums, "of_file", lambda path: hashed.append(path.name) or real(path))
    final = ckpt.commit(tmp_path, 3, {"backend": "cpu"}, keep_last_n=2)
    assert hashed == ["config.json"]  # rank 0 hashed nothing another rank reported
    listing = ckpt.read_manifest(final)["files"]
    assert set(listing) == {"config.json", *files[0], *files[1]}
    assert listing["model-00002-of-00002.safetensors"] == {"bytes": 32, "xxh3_128": xxhash.xxh3_128(b"b" * 32).hexdigest()}
    assert not (final / ckpt.REPORTS).exists()
    monkeypatch.setattr(checksums, "of_file", real)
    assert ckpt.verify(final)["step"] == 3


def test_a_digest_computed_while_writing_is_taken_as_given(tmp_path):
    staging = ckpt.prepare_staging(tmp_path, 1)
    (staging / "w.bin").write_bytes(b"xyz")
    digest = {"bytes": 3, "xxh3_128": xxhash.xxh3_128(b"xyz").hexdigest()}
    ckpt.write_report(staging, 0, {staging / "w.bin": digest})
    assert json.loads((staging / ckpt.REPORTS / "rank_00000.json").read_text()) == {"w.bin": digest}


def manifest_of(sizes):
    return {"files": {name: {"bytes": size, "xxh3_128": ""} for name, size in sizes.items()}}


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_each_file_is_verified_by_one_rank_and_the_bytes_are_shared(world_size):
    sizes = {f"model-{i:05d}.safetensors": 5_000 for i in range(12)} | {"optimizer.pt": 9_000, "config.json": 700,
                                                                          "rng/rank_00000.pt": 10}
    manifest = manifest_of(sizes)
    shares = [ckpt.verify_share(manifest, rank, world_size) for rank in range(world_size)]
    assert sorted(p.name for share in shares for p in share) == sorted(sizes)  # every file once, whole
    loads = [sum(p.length for p in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())  # within one file of each other


def test_a_sharded_checkpoint_is_verified_rank_by_rank_in_one_pass_each():
    """At the world size it was saved at, rank r checks about its own `.distcp` file (the one its load reads),
    `__10_0` after `__9_0`; each share is one run of the files in order."""
    sizes = {f"sharded/__{r}_0.distcp": 1_000_000 for r in range(12)} | {"sharded/.metadata": 3_000,
                                                                        "config.json": 700}
    manifest = manifest_of(sizes)
    shares = [ckpt.verify_share(manifest, rank, 12) for rank in range(12)]
    for rank, share in enumerate(shares):
        assert f"sharded/__{rank}_0.distcp" in [p.name for p in share]
    in_order = [p.name for share in shares for p in share]
    assert in_order == ["config.json", "sharded/.metadata", *(f"sharded/__{r}_0.distcp" for r in range(12))]


def test_a_corrupt_file_is_found_by_the_rank_whose_share_it_is(tmp_path):
    final = save(tmp_path, 4, {"a.bin": b"a" * 100, "b.bin": b"b" * 90, "c.bin": b"c" * 10})
    manifest = ckpt.read_manifest(final)
    owner = next(r for r in range(2) if "b.bin" in [p.name for p in ckpt.verify_share(manifest, r, 2)])
    (final / "b.bin").write_bytes(b"B" * 90)  # same size: only a checksum finds it
    ckpt.verify(final, 1 - owner, 2)
    with user_error("train.resume", "b.bin does not match its checksum"):
        ckpt.verify(final, owner, 2)
    (final / "c.bin").write_bytes(b"c" * 9)  # a size every rank checks
    for rank in range(2):
        with user_error("train.resume", "c.bin does not match its checksum"):
            ckpt.verify(final, rank, 2)


def test_the_waits_of_a_70b_save_grow_with_its_bytes():
    """Llama-3-70B in fp32 with AdamW: 70.6e9 parameters x (4 + 8) bytes = 847 GB. At 100 MB/s one rank may
    take 8,470 s to write (or hash) that, far past the 300 s collective timeout that bounded the old barrier."""
    n_params = 70_553_706_496
    nbytes = ckpt.checkpoint_bytes(n_params)
    assert nbytes == 846_644_477_952
    assert ckpt.checkpoint_bytes(n_params, weight_bytes=2) == n_params * 10  # a bfloat16 export
    bound = ckpt.wait_bound_s(n_params, floor_s=300)
    assert bound == pytest.approx(300 + 8466.44, abs=0.01)
    assert 300 * ckpt.IO_BYTES_PER_S < nbytes / 28  # the old 300 s allowed 30 GB at that rate, 1/28 of it
    # The waits left inside a collective of the default timeout (a FULL save gathers one tensor at a time): the
    # largest tensor's write, the 128,256 x 8,192 fp32 embedding: 4.2 GB, 42 s at the same rate.
    embedding = 128_256 * 8_192 * 4
    assert ckpt.io_timeout_s(embedding, floor_s=0) == pytest.approx(42.0, abs=0.1)
    assert ckpt.wait_bound_s(1000, floor_s=300) == pytest.approx(300, abs=0.001)  # small models: the floor


@pytest.mark.parametrize("piece", [ckpt.HashingWriter.PIECE, 7])  # 7: each write hashed and written in parts
def test_a_file_written_through_hashing_writer_is_checksummed_on_the_way(tmp_path, monkeypatch, piece):
    monkeypatch.setattr(ckpt.HashingWriter, "PIECE", piece)
    pieces = [b"header", bytearray(b"x" * 1000), memoryview(b"tail"), memoryview(bytes(range(256)) * 4).cast("I")]
    with ckpt.HashingWriter(tmp_path / "optimizer.pt") as f:
        for piece in pieces:
            f.write(piece)
    data = (tmp_path / "optimizer.pt").read_bytes()
    assert data == b"".join(p.tobytes() if isinstance(p, memoryview) else bytes(p) for p in pieces)
    assert f.digest == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()} == ckpt.digest(f.path)
