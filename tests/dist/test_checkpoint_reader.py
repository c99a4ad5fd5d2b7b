"""The SHARDED loader's file reader (backends/torch/checkpoint_reader.py) restores what torch.distributed.checkpoint
saved exactly as dcp's own reader does: every dtype, 0-d and empty tensors, a saved tensor that is not contiguous,
a destination that is not, and the non-tensor entries dcp stores as bytes. In one process (dcp without a group)."""
import torch
import torch.distributed.checkpoint as dcp

from portable_fsdp.backends.torch.checkpoint_reader import Reader


def _saved() -> dict:
    torch.manual_seed(0)
    return {"weight": torch.randn(64, 48), "half": torch.randn(17, 5).to(torch.bfloat16), "step": torch.tensor(7.0),
            "ids": torch.arange(11, dtype=torch.int64), "empty": torch.zeros(0, 4),
            "transposed": torch.randn(8, 24).t(), "extra": {"name": "adamw", "lr": 3e-4}}


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else {"name": "", "lr": 0.0} for k, v in state.items()}


def test_the_reader_restores_what_dcp_saved(tmp_path, monkeypatch):
    saved = _saved()
    mine, theirs = _blank(saved), _blank(saved)
    mine["into_a_view"] = theirs["into_a_view"] = torch.zeros(48, 64).t()  # a destination that is not contiguous
    dcp.save({**saved, "into_a_view": saved["weight"]}, checkpoint_id=str(tmp_path))
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
