"""torch.distributed.checkpoint's file reader, reading each tensor's bytes once, straight into place.

dcp's FileSystemReader `torch.load`s every saved tensor from its slice of a `.distcp` file: a fresh storage
filled from the file, then copied into the tensor it restores. A SHARDED resume at the same world size asks for
whole saved tensors, so `Reader` reads their bytes from the file into the destination itself (one copy, no
allocation); a part of a saved tensor (another world size), or one whose destination is on a GPU, is read into a
host buffer and copied. What a saved tensor is (dtype, shape, strides) comes from the record's pickle, read by the
C unpickler allowed only the names a plain tensor's record uses (`torch.load`'s own restricted unpickler is Python:
a resume spent most of its parsing there); where its bytes are, from the zip archive `torch.save` wrote
(`zipfile`'s directory; the records are read by their local headers, since their CRC-32 may be left out). Anything
else (bytes items, transformed or unexpected records) goes through dcp's own reader.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import typing
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

# the storage classes a record's pickle names (torch.FloatStorage, ...) and the dtypes they stand for
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


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


class _Layout(typing.NamedTuple):
    dtype: torch.dtype
    key: str  # the storage's record: data/<key>
    storage_offset: int
    size: tuple
    stride: tuple


def _layout(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _Layout(*storage, storage_offset, tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """A plain tensor's `data.pkl` as its _Layout. It resolves only the names such a record uses, so any other
    record (a tensor subclass, a different object) fails to parse rather than building anything."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout
        if (module, name) == ("collections", "OrderedDict"):  # the (empty) backward hooks
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        return dtype, str(key)


def _stored_at(blob: _Slice, info: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed record's bytes start, from its local header (its name's and extra field's lengths
    at bytes 26-29); None if it is compressed or the header is not one."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    blob.seek(info.header_offset)
    header = blob.read(30)
    if header[:4] != b"PK\x03\x04":
        return None
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def _parse(blob: _Slice) -> tuple | None:
    """(layout, offset of its storage's bytes, their length) of the one tensor a `torch.save` archive holds; None
    if it holds anything else."""
    try:
        with zipfile.ZipFile(blob) as archive:
            records = {info.filename: info for info in archive.infolist()}
    except zipfile.BadZipFile:
        return None
    pickled = [name for name in records if name.endswith("/data.pkl")]
    if len(pickled) != 1 or sum("/data/" in name for name in records) != 1:
        return None
    prefix = pickled[0][: -len("data.pkl")]
    begin = _stored_at(blob, records[pickled[0]])
    if begin is None:
        return None
    blob.seek(begin)
    try:
        layout = _LayoutUnpickler(io.BytesIO(blob.read(records[pickled[0]].file_size))).load()
    except Exception:  # noqa: BLE001 - whatever the record is, dcp's own reader parses (or rejects) it
        return None
    data = records.get(f"{prefix}data/{layout.key}") if isinstance(layout, _Layout) else None
    start = _stored_at(blob, data) if data is not None else None
    return None if start is None else (layout, start, data.file_size)


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
        parsed = _parse(_Slice(file, info.offset, info.length))
        if parsed is None:
            return False
        layout, start, nbytes = parsed
        saved = torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype, device="meta")  # shape only
        extent = layout.storage_offset + sum((n - 1) * step for n, step in zip(layout.size, layout.stride)) + 1
        if extent * saved.element_size() > nbytes:
            return False
        start += info.offset
        target = planner.resolve_tensor(item).detach()
        if target.size() != torch.Size(item.lengths):
            raise RuntimeError(f"{item.storage_index}: {tuple(item.lengths)} in the checkpoint, "
                               f"{tuple(target.size())} in the state")
        if (target.size() == saved.size() and layout.storage_offset == 0 and saved.is_contiguous()
                and saved.nbytes == nbytes and target.is_contiguous() and target.dtype == saved.dtype
                and target.device.type == "cpu"):
            _read_exactly(file, start, target)  # the whole saved tensor: its bytes straight into place
        # otherwise (a part of it, another layout, or a GPU destination): through a host buffer
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            _read_exactly(file, start, buffer)
            stored = torch.empty(0, dtype=layout.dtype).set_(buffer.untyped_storage(), layout.storage_offset,
                                                              layout.size, layout.stride)
            for dim, (begin, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, begin, length)
            target.copy_(stored)
        planner.commit_tensor(item, target)
        return True
