"""Checksums of checkpoint files, block by block, so that the ranks of a resume can verify one large file together.

A file's manifest entry: {"bytes": n, "xxh3_128": hex} up to BLOCK bytes, else {"bytes": n, "block_bytes": BLOCK,
"block_xxh3_128": [hex of each block]}. One checksum pass costs the same either way; the blocks let a resume spread
`optimizer.pt` (one file of 8 bytes per parameter) over every rank instead of leaving it to one. XXH3-128 (xxhash;
`xxh128sum` prints a whole file's) catches what a disk or a copy damages at the speed of memory, where sha256
(~1.7 GB/s per core) leaves a resume waiting on the hashing rather than the disk. Entries of sha256 (`"sha256"`,
`"block_sha256"`), as earlier versions wrote them, still verify. Imports no framework.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pathlib
import typing

import xxhash

BLOCK = 64 * 2**20
_READ = 8 * 2**20
# the hashes an entry may name; a checkpoint is written with WRITTEN
ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
WRITTEN = "xxh3_128"


class Checksum:
    """The manifest entry of a byte stream fed in pieces of any size (`update`), as it is written."""

    def __init__(self):
        self.block_bytes, self.nbytes = BLOCK, 0
        self._blocks: list = []
        self._hash, self._in_block = ALGORITHMS[WRITTEN](), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.nbytes += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, self.block_bytes - self._in_block)
            self._hash.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self.block_bytes:
                self._blocks.append(self._hash.hexdigest())
                self._hash, self._in_block = ALGORITHMS[WRITTEN](), 0

    def entry(self) -> dict:
        blocks = self._blocks + ([self._hash.hexdigest()] if self._in_block or not self._blocks else [])
        if len(blocks) == 1:
            return {"bytes": self.nbytes, WRITTEN: blocks[0]}
        return {"bytes": self.nbytes, "block_bytes": self.block_bytes, f"block_{WRITTEN}": blocks}


class Piece(typing.NamedTuple):
    """A stretch of one file and the digest it must have (of `algorithm`): a whole file, or one block of a large one."""
    name: str
    offset: int
    length: int
    algorithm: str
    digest: str


def pieces(name: str, entry: dict) -> list:
    for algorithm in ALGORITHMS:
        if algorithm in entry:
            return [Piece(name, 0, entry["bytes"], algorithm, entry[algorithm])]
        if f"block_{algorithm}" in entry:
            size, block = entry["bytes"], entry["block_bytes"]
            return [Piece(name, i * block, min(block, size - i * block), algorithm, digest)
                    for i, digest in enumerate(entry[f"block_{algorithm}"])]
    raise ValueError(f"the manifest entry of {name} holds no checksum this version reads ({', '.join(ALGORITHMS)})")


def of_file(path: pathlib.Path) -> dict:
    """The manifest entry of a file already on disk."""
    checksum = Checksum()
    with open(path, "rb", buffering=0) as f:
        for chunk in iter(lambda: f.read(_READ), b""):
            checksum.update(chunk)
    return checksum.entry()


def matching(directory: pathlib.Path, share: list) -> typing.Iterator[tuple]:
    """(piece, whether its bytes match) for each piece of `share`, in order. A thread reads the next chunk while
    this one is hashed (both release the interpreter's lock), so a cold read and the hashing overlap."""
    chunks = [(i, piece.name, offset, min(_READ, piece.offset + piece.length - offset))
              for i, piece in enumerate(share) for offset in range(piece.offset, piece.offset + piece.length, _READ)]
    buffers, files = (bytearray(_READ), bytearray(_READ)), {}

    def read(k: int) -> int:
        _, name, offset, length = chunks[k]
        if name not in files:
            files[name] = os.open(pathlib.Path(directory) / name, os.O_RDONLY)
        return os.preadv(files[name], [memoryview(buffers[k % 2])[:length]], offset)

    digests = [ALGORITHMS[piece.algorithm]() for piece in share]
    done = 0  # the pieces before it are reported
    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-verify") as reader:
            ahead = reader.submit(read, 0) if chunks else None
            for k, (i, _, _, _) in enumerate(chunks):
                got = ahead.result()
                ahead = reader.submit(read, k + 1) if k + 1 < len(chunks) else None
                digests[i].update(memoryview(buffers[k % 2])[:got])  # short of the piece: the digest differs
                complete = chunks[k + 1][0] if ahead else len(share)  # pieces before the next chunk's are whole
                for j in range(done, complete):
                    yield share[j], digests[j].hexdigest() == share[j].digest
                done = max(done, complete)
        for j in range(done, len(share)):  # no chunk at all: empty pieces
            yield share[j], digests[j].hexdigest() == share[j].digest
    finally:
        for fd in files.values():
            os.close(fd)
