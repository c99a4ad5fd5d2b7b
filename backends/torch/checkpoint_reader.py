"""torch.distributed.checkpoint's file reader, reading each tensor's bytes once, straight into place.

dcp's FileSystemReader `torch.load`s every saved tensor from its slice of a `.distcp` file: a fresh storage
filled from the file, then copied into the tensor it restores. A SHARDED resume at the same world size asks for
whole saved tensors, so `Reader` reads their bytes from the file into the destination itself (one copy, no
allocation); a part of a saved tensor (another world size), or one whose destination is on a GPU, is read into a
host buffer and copied. What a saved tensor is (dtype, shape, strides) still comes from `torch.load`, without its
data (`torch.serialization.skip_data`); where its bytes are, from the zip archive `torch.save` wrote (`zipfile`).
Anything else (bytes items, transformed or unexpected records) goes through dcp's own reader.
"""
from __future__ import annotations

import dataclasses
import io
import os
import re
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

_DATA_RECORD = re.compile(r"(^|/)data/\d+$")


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own (what `zipfile` needs).
    Its first and last EDGE bytes are read up front: a `torch.save` archive keeps its small records there and its
    directory at the end, so parsing one costs two reads, not one per field."""

    EDGE = 4096

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self._fd, self._offset, self._length, self._pos = file.fileno(), offset, length, 0
        self._head = os.pread(self._fd, min(length, self.EDGE), offset)
        self._tail_start = max(len(self._head), length - self.EDGE)
        self._tail = os.pread(self._fd, length - self._tail_start, offset + self._tail_start)

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + offset, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: self._length - self._pos]
        for start, edge in ((0, self._head), (self._tail_start, self._tail)):
            if start <= self._pos and self._pos + view.nbytes <= start + len(edge):
                view[:] = edge[self._pos - start: self._pos - start + view.nbytes]
                n = view.nbytes
                break
        else:
            n = os.preadv(self._fd, [view], self._offset + self._pos)
        self._pos += n
        return n


def _data_record(blob: _Slice) -> tuple | None:
    """(offset, bytes) of the single storage inside one `torch.save` archive; None if the archive holds another
    number of storages or a compressed one."""
    with zipfile.ZipFile(blob) as archive:
        records = [info for info in archive.infolist() if _DATA_RECORD.search(info.filename)]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    blob.seek(records[0].header_offset)
    header = blob.read(30)  # the local file header: its name's and extra field's lengths at bytes 26-29
    if header[:4] != b"PK\x03\x04":
        return None
    start = records[0].header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return start, records[0].file_size


def _read_exactly(file, offset: int, tensor: torch.Tensor) -> None:
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    file.seek(offset)
    while view.nbytes:
        n = file.readinto(view)
        if not n:
            raise EOFError(f"{file.name} ends before the tensor at byte {offset}")
        view = view[n:]


class Reader(dcp.FileSystemReader):
    """`dcp.load(..., storage_reader=Reader(path))`: dcp's FileSystemReader, each tensor read once into place."""

    def read_data(self, plan, planner):
        per_file: dict = {}
        rest = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            direct = item.type == LoadItemType.TENSOR and not info.transform_descriptors
            (per_file.setdefault(info.relative_path, []) if direct else rest).append(item)
        for relative_path, items in per_file.items():
            with open(os.path.join(self.path, relative_path), "rb", buffering=0) as file:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    if not self._read_tensor(file, item, planner):
                        rest.append(item)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _read_tensor(self, file, item, planner) -> bool:
        """The part of a saved tensor that `item` asks for, read into its destination; False (nothing read) if
        the tensor's record is not a plain one."""
        info = self.storage_data[item.storage_index]
        blob = _Slice(file, info.offset, info.length)
        with torch.serialization.skip_data():  # the tensor's dtype, shape and strides; its bytes are not read
            saved = torch.load(blob, map_location="cpu", weights_only=True)
        record = _data_record(blob)
        extent = saved.storage_offset() + sum((n - 1) * step for n, step in zip(saved.size(), saved.stride())) + 1
        if record is None or extent * saved.element_size() > record[1]:
            return False
        start, nbytes = info.offset + record[0], record[1]
        target = planner.resolve_tensor(item).detach()
        if target.size() != torch.Size(item.lengths):
            raise RuntimeError(f"{item.storage_index}: {tuple(item.lengths)} in the checkpoint, "
                               f"{tuple(target.size())} in the state")
        if (target.size() == saved.size() and saved.storage_offset() == 0 and saved.is_contiguous()
                and saved.nbytes == nbytes and target.is_contiguous() and target.dtype == saved.dtype
                and target.device.type == "cpu"):
            _read_exactly(file, start, target)  # the whole saved tensor: its bytes straight into place
        # otherwise (a part of it, another layout, or a GPU destination): through a host buffer
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            _read_exactly(file, start, buffer)
            stored = torch.empty(0, dtype=saved.dtype).set_(buffer.untyped_storage(), saved.storage_offset(),
                                                             saved.size(), saved.stride())
            for dim, (begin, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, begin, length)
            target.copy_(stored)
        planner.commit_tensor(item, target)
        return True
