"""A FULL checkpoint's weights as `save_pretrained` lays them out, written one tensor at a time (never the whole
model in one place), and found again through the index.

One file `model.safetensors` when everything fits in `train.max_shard_size`, else `model-00001-of-0000N.safetensors`
... plus `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {tensor: file}}), as
transformers writes them. Shards are cut in the tensors' order (a tensor larger than the limit gets a file of its
own) and written by every rank in turn, so N ranks write (and checksum) in parallel: shard i by rank
(world_size - 1 - i) mod world_size, the last rank first, since rank 0 also writes the index and, in a FULL save,
optimizer.pt at the same time. Each rank calls `Writer.write` for the tensors it owns, in order, as they are
gathered: a shard's header (names, dtypes, shapes, offsets) is known from the plan before its first byte, so each
tensor's bytes go straight to disk, hashed on their way. No framework here: tensors arrive as raw little-endian
bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import struct

from portable_fsdp.checkpoint import checksums
from portable_fsdp.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# dtype name (torch's and numpy's spelling) -> (safetensors code, bytes per element)
DTYPES = {"float64": ("F64", 8), "float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2),
          "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
          "bool": ("BOOL", 1)}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """"5GB" -> 5·10⁹ bytes (KB/MB/GB powers of ten and KiB/MiB/GiB powers of two, as transformers reads them)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def plan_shards(tensors: list, max_bytes: int) -> list:
    """[[Tensor]]: consecutive tensors, each shard at most `max_bytes` unless one tensor alone is larger."""
    shards, size = [[]], 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards if shards[0] else []


def file_names(count: int) -> list:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(shard: list, metadata: dict) -> bytes:
    entries, offset = {}, 0
    for t in shard:
        entries[t.name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(blob)) + blob


class Writer:
    """Every rank builds one from the same tensor list; each writes the shards it owns (`owner(name) == rank`),
    calling `write(name, data)` for its tensors in the list's order, then `close()`."""

    def __init__(self, directory: pathlib.Path, tensors: list, max_bytes: int, rank: int, world_size: int,
                 metadata: dict | None = None):
        self.directory, self.rank, self.world_size = pathlib.Path(directory), rank, world_size
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards = plan_shards(list(tensors), max_bytes)
        self.files = file_names(len(self.shards))
        self._shard_of = {t.name: i for i, shard in enumerate(self.shards) for t in shard}
        self._todo = [t for i, shard in enumerate(self.shards) if self._owner_of(i) == rank for t in shard]
        self._next, self._open, self._checksum = 0, None, None
        self.written: dict = {}  # path -> its manifest entry (checksums.Checksum), of the files this rank wrote

    def _owner_of(self, shard: int) -> int:
        return (self.world_size - 1 - shard) % self.world_size

    def owner(self, name: str) -> int:
        return self._owner_of(self._shard_of[name])

    def write(self, name: str, data) -> None:
        """`data`: the tensor's bytes (a C-contiguous buffer: bytes, a uint8 numpy view)."""
        expected = self._todo[self._next] if self._next < len(self._todo) else None
        if expected is None or expected.name != name:
            raise ValueError(f"rank {self.rank} writes {name}, expected {expected.name if expected else 'nothing'}")
        view = memoryview(data).cast("B")
        if view.nbytes != expected.nbytes:
            raise ValueError(f"{name}: {view.nbytes} bytes, its {expected.dtype} {list(expected.shape)} take {expected.nbytes}")
        shard = self._shard_of[name]
        if self._open is None:
            self._open = open(self.directory / self.files[shard], "wb")
            self._checksum = checksums.Checksum()
            self._put(_header(self.shards[shard], self.metadata))
        self._put(view)
        self._next += 1
        if self.shards[shard][-1].name == name:
            self._finish(self.directory / self.files[shard])

    def _put(self, data) -> None:
        self._open.write(data)
        self._checksum.update(data)

    def _finish(self, path: pathlib.Path) -> None:
        self._open.flush()
        os.fsync(self._open.fileno())
        self._open.close()
        self._open = None
        self.written[path] = self._checksum.entry()

    def close(self) -> dict:
        """Rank 0 adds the index (several shards). Returns {path: manifest entry} of this rank's files."""
        if self._next != len(self._todo):
            raise ValueError(f"rank {self.rank} wrote {self._next} of its {len(self._todo)} tensors")
        if self.rank == 0 and len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for s in self.shards for t in s)},
                     "weight_map": {t.name: self.files[i] for i, s in enumerate(self.shards) for t in s}}
            path = self.directory / INDEX
            data = json.dumps(index, indent=2).encode()
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            checksum = checksums.Checksum()
            checksum.update(data)
            self.written[path] = checksum.entry()
        return self.written


def weight_files(directory: pathlib.Path, field: str) -> list:
    """The safetensors files of a model directory: those its index names (every one must be there), else
    model.safetensors, else every *.safetensors file. `field` is blamed when the index names a missing file."""
    directory = pathlib.Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(field, f"{index} is unreadable (no weight_map); the checkpoint is corrupt: use another "
                            "one") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UserError(field, f"{index} names {missing[0]}{more}, which is missing: the checkpoint is incomplete; "
                            "copy the file back or use another checkpoint")
        return [directory / n for n in names]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    return sorted(directory.glob("*.safetensors"))
