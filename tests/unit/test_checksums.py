"""Checkpoint files checksummed block by block, and the blocks of one large file verified by several ranks
(portable_fsdp/checkpoint/checksums.py, checkpointing.verify)."""
import hashlib
import json
import os

import pytest
import xxhash

from portable_fsdp.checkpoint import checksums, layout as ckpt
from tests.unit._helpers import user_error


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 1,000 bytes and reads of 300 (64 MiB and 8 MiB in use): every boundary is crossed."""
    monkeypatch.setattr(checksums, "BLOCK", 1000)
    monkeypatch.setattr(checksums, "_READ", 300)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def test_a_file_s_digest_is_what_xxh128sum_prints():
    assert xxh(b"") == "99aa06d3014798d86001c324468d497f"  # xxh128sum of an empty file
    checksum = checksums.Checksum()
    checksum.update(b"")
    assert checksum.entry() == {"bytes": 0, "xxh3_128": "99aa06d3014798d86001c324468d497f"}


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 3500, 4000])
def test_a_stream_fed_in_any_pieces_gets_one_digest_per_block(small_blocks, size):
    data = os.urandom(size)
    checksum = checksums.Checksum()
    for start in range(0, size, 137):  # pieces that straddle the blocks
        checksum.update(data[start:start + 137])
    blocks = [data[i:i + 1000] for i in range(0, size, 1000)] or [b""]
    if len(blocks) == 1:  # one block: the file's own digest
        assert checksum.entry() == {"bytes": size, "xxh3_128": xxh(data)}
    else:
        assert checksum.entry() == {"bytes": size, "block_bytes": 1000, "block_xxh3_128": [xxh(b) for b in blocks]}


def test_a_file_on_disk_has_the_entry_of_its_bytes_written_as_a_stream(small_blocks, tmp_path):
    data = os.urandom(2500)
    (tmp_path / "f.bin").write_bytes(data)
    checksum = checksums.Checksum()
    checksum.update(data)
    assert checksums.of_file(tmp_path / "f.bin") == checksum.entry()
    assert len(checksum.entry()["block_xxh3_128"]) == 3


def committed(tmp_path, files):
    staging = ckpt.prepare_staging(tmp_path, 1)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    return ckpt.commit(tmp_path, 1, {"backend": "cpu"}, keep_last_n=1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_blocks_of_one_large_file_are_verified_by_every_rank(small_blocks, tmp_path, world_size):
    """optimizer.pt is most of a FULL checkpoint's bytes: by blocks, every rank hashes about as much."""
    final = committed(tmp_path, {"optimizer.pt": os.urandom(9500), "model.safetensors": os.urandom(2200),
                                 "config.json": b"{}"})
    manifest = ckpt.read_manifest(final)
    assert len(manifest["files"]["optimizer.pt"]["block_xxh3_128"]) == 10
    shares = [ckpt.verify_share(manifest, rank, world_size) for rank in range(world_size)]
    every = sorted((p.name, p.offset) for share in shares for p in share)
    assert len(every) == len(set(every)) == 10 + 3 + 1  # each block once
    assert {rank for rank, share in enumerate(shares) for p in share if p.name == "optimizer.pt"} == set(range(world_size))
    loads = [sum(p.length for p in share) for share in shares]
    assert max(loads) - min(loads) <= 1000
    for rank in range(world_size):
        assert ckpt.verify(final, rank, world_size)["step"] == 1


def test_a_flipped_byte_in_a_block_is_found_by_the_rank_that_hashes_that_block(small_blocks, tmp_path):
    data = bytearray(os.urandom(5000))
    final = committed(tmp_path, {"optimizer.pt": bytes(data)})
    data[3456] ^= 1  # block 3, same size: only its checksum tells
    (final / "optimizer.pt").write_bytes(bytes(data))
    shares = [ckpt.verify_share(ckpt.read_manifest(final), rank, 2) for rank in range(2)]
    owner = next(r for r in range(2) if any(p.offset == 3000 for p in shares[r]))
    ckpt.verify(final, 1 - owner, 2)
    with user_error("train.resume", "optimizer.pt does not match its checksum"):
        ckpt.verify(final, owner, 2)
    with user_error("train.resume", "optimizer.pt does not match its checksum"):
        ckpt.verify(final)  # one process hashes every block


def test_pieces_are_reported_in_order_with_empty_files_among_them(small_blocks, tmp_path):
    files = {"a.bin": os.urandom(1700), "b.bin": b"", "c.bin": os.urandom(40), "d.bin": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    share = [p for name in files for p in checksums.pieces(name, checksums.of_file(tmp_path / name))]
    assert [(p.name, p.offset, p.length) for p in share] == [
        ("a.bin", 0, 1000), ("a.bin", 1000, 700), ("b.bin", 0, 0), ("c.bin", 0, 40), ("d.bin", 0, 0)]
    assert list(checksums.matching(tmp_path, share)) == [(p, True) for p in share]
    assert list(checksums.matching(tmp_path, share[2:3])) == [(share[2], True)]  # only an empty file


@pytest.mark.parametrize("written_as", ["sha256 per file", "sha256 per block"])
def test_a_manifest_of_sha256_digests_still_verifies(small_blocks, tmp_path, written_as):
    """Checkpoints of earlier versions: sha256 of every file, however large (here 3 blocks' worth), or of every
    block."""
    data = bytearray(os.urandom(3000))
    final = committed(tmp_path, {"optimizer.pt": bytes(data)})
    manifest = ckpt.read_manifest(final)
    if written_as == "sha256 per file":
        manifest["files"]["optimizer.pt"] = {"bytes": 3000, "sha256": sha(bytes(data))}
        shares = sorted((ckpt.verify_share(manifest, rank, 2) for rank in range(2)), key=len)
        assert shares == [[], [checksums.Piece("optimizer.pt", 0, 3000, "sha256", sha(bytes(data)))]]  # one piece
    else:
        manifest["files"]["optimizer.pt"] = {"bytes": 3000, "block_bytes": 1000,
                                             "block_sha256": [sha(bytes(data[i:i + 1000])) for i in (0, 1000, 2000)]}
    (final / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.verify(final, 0, 2)["step"] == 1 and ckpt.verify(final, 1, 2)["step"] == 1
    data[2999] ^= 1
    (final / "optimizer.pt").write_bytes(bytes(data))
    with user_error("train.resume", "optimizer.pt does not match its checksum"):
        ckpt.verify(final)


def test_a_manifest_entry_of_an_unknown_hash_is_refused_in_one_line(tmp_path):
    final = committed(tmp_path, {"optimizer.pt": b"x" * 10})
    manifest = ckpt.read_manifest(final)
    manifest["files"]["optimizer.pt"] = {"bytes": 10, "blake3": "00"}
    (final / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with user_error("train.resume", "the manifest entry of optimizer.pt holds no checksum this version reads "
                    "(xxh3_128, sha256); resume from another checkpoint"):
        ckpt.verify_sizes(final)
