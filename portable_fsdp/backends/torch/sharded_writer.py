"""torch.distributed.checkpoint's save, each rank's files checksummed on their way to disk.

dcp's FileSystemWriter appends every tensor to the rank's `.distcp` file as a `torch.save` record. Here its
stream is a `checkpointing.HashingWriter`, so the manifest's checksums (XXH3-128 per 64 MiB block) come from the
bytes as they are written, not from reading the files back; and the records skip zip's CRC-32, which those
checksums cover end to end (`torch.load` does not need it). Used by the synchronous save in the training process
and by train.async_save's writer process (save_process).
"""
from __future__ import annotations

import contextlib
import pathlib
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from portable_fsdp.checkpoint import layout as checkpointing

# dcp's file writer itself calls the deprecated `Tensor.storage()` (torch 2.9): a warning per rank and save that the
# user can do nothing about.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                        module="torch.distributed.checkpoint.filesystem")


def save(state_dict: dict, directory, rank: int, process_group=None) -> dict:
    """dcp.save of `state_dict` under `directory`: {path: manifest entry} of the files this rank wrote; rank 0's
    `.metadata` (small, written through a temporary name) maps to None: checksummed once it is in place."""
    writer = dcp.FileSystemWriter(directory)
    writer.fs = _HashingFileSystem()
    with _without_zip_crc():
        dcp.save(state_dict, storage_writer=writer, process_group=process_group)
    files = written_files(directory, rank)
    return {path: writer.fs.entries.get(path) for path in files}


def written_files(directory, rank: int) -> list:
    """The files torch.distributed.checkpoint's file writer leaves for `rank` in `directory` (rank 0: and the
    metadata)."""
    directory = pathlib.Path(directory)
    return sorted(directory.glob(f"__{rank}_*.distcp")) + sorted(directory.glob(".metadata") if rank == 0 else [])


class _HashingFileSystem(FileSystem):
    """dcp's local file system, whose files opened for writing checksum what goes through them."""

    def __init__(self):
        super().__init__()
        self.entries: dict = {}  # path: manifest entry, once the file is closed (fsynced)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with checkpointing.HashingWriter(path) as writer:
            yield writer
        self.entries[pathlib.Path(path)] = writer.digest


@contextlib.contextmanager
def _without_zip_crc():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)
