"""The SHARDED loader's file reader (portable_fsdp/backends/torch/checkpoint_reader.py) restores what torch.distributed.checkpoint
saved exactly as dcp's own reader does: every dtype, 0-d and empty tensors, a saved tensor that is not contiguous,
a destination that is not, and the non-tensor entries dcp stores as bytes — from files dcp's own writer wrote and
from ours (sharded_writer: checksummed as written, no zip CRC-32). In one process (dcp without a group)."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from portable_fsdp.checkpoint import checksums
from portable_fsdp.backends.torch import sharded_writer
from portable_fsdp.backends.torch.checkpoint_reader import Reader, _parse, _Slice

WRITERS = {"dcp": lambda state, path: dcp.save(state, checkpoint_id=str(path)),
           "ours": lambda state, path: sharded_writer.save(state, path, rank=0)}


def _saved() -> dict:
    torch.manual_seed(0)
    return {"weight": torch.randn(64, 48), "half": torch.randn(17, 5).to(torch.bfloat16), "step": torch.tensor(7.0),
            "ids": torch.arange(11, dtype=torch.int64), "empty": torch.zeros(0, 4),
            "transposed": torch.randn(8, 24).t(), "extra": {"name": "adamw", "lr": 3e-4}}


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else {"name": "", "lr": 0.0} for k, v in state.items()}


@pytest.mark.parametrize("writer", WRITERS)
def test_the_reader_restores_what_dcp_saved(tmp_path, monkeypatch, writer):
    saved = _saved()
    mine, theirs = _blank(saved), _blank(saved)
    mine["into_a_view"] = theirs["into_a_view"] = torch.zeros(48, 64).t()  # a destination that is not contiguous
    WRITERS[writer]({**saved, "into_a_view": saved["weight"]}, tmp_path)
    handed_on = []  # what the reader leaves to dcp's own: the entries stored as bytes, no tensor
    original = dcp.FileSystemReader.read_data
    monkeypatch.setattr(dcp.FileSystemReader, "read_data",
                        lambda self, plan, planner: handed_on.extend(plan.items) or original(self, plan, planner))
    dcp.load(mine, storage_reader=Reader(tmp_path))
    assert sorted(i.storage_index.fqn for i in handed_on) == ["extra.lr", "extra.name"]
    monkeypatch.undo()
    dcp.load(theirs, checkpoint_id=str(tmp_path))
    for name, value in saved.items():
        if torch.is_tensor(value):
            assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
            assert torch.equal(theirs[name], value), name
        else:
            assert mine[name] == theirs[name] == value
    assert not mine["into_a_view"].is_contiguous() and torch.equal(mine["into_a_view"], saved["weight"])


def test_our_writer_checksums_each_file_as_written(tmp_path, monkeypatch):
    files = sharded_writer.save(_saved(), tmp_path, rank=0)
    shards = [path for path in files if path.suffix == ".distcp"]
    assert shards and sorted(files) == sorted(sharded_writer.written_files(tmp_path, 0))
    assert all(files[path] == checksums.of_file(path) for path in shards)  # the bytes on disk, not read back
    assert files[tmp_path / ".metadata"] is None  # written under a temporary name: checksummed once in place
    assert torch.serialization.get_crc32_options()  # zip's CRC-32 is skipped only while it writes

    monkeypatch.setattr(dcp, "save", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sharded_writer.save(_saved(), tmp_path / "failed", rank=0)
    assert torch.serialization.get_crc32_options()


def test_only_a_plain_tensors_record_is_read_by_the_reader_itself(tmp_path):
    """The record's pickle is parsed with only a plain tensor's names allowed: anything else (a Parameter, a dict,
    bytes that are no archive) is left to dcp's own reader, which parses or rejects it."""
    path = tmp_path / "records"
    with open(path, "wb") as f:
        torch.save(torch.arange(12, dtype=torch.float32).reshape(3, 4).t()[1:], f)
        ends = [f.tell()]
        for other in (torch.nn.Parameter(torch.randn(2)), {"a": torch.randn(2)}):
            torch.save(other, f)
            ends.append(f.tell())
    with open(path, "rb", buffering=0) as f:
        layout, start, nbytes = _parse(_Slice(f, 0, ends[0]))
        assert (layout.dtype, layout.storage_offset, layout.size, layout.stride) == (torch.float32, 1, (3, 3), (1, 4))
        assert nbytes == 48 and bytes(_Slice(f, start, nbytes).read()) == torch.arange(12.0).numpy().tobytes()
        assert _parse(_Slice(f, ends[0], ends[1] - ends[0])) is None
        assert _parse(_Slice(f, ends[1], ends[2] - ends[1])) is None
        assert _parse(_Slice(f, 1, ends[0] - 1)) is None
