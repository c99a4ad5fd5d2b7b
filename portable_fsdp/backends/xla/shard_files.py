"""SPMD SHARDED_STATE_DICT files: one safetensors file per device holding that device's shard of every tensor,
and `index.json` naming each tensor's global shape, dtype and sharding. Each process writes and reads only the
devices it drives, so nothing is gathered; resuming needs the same mesh (the same sharding of every tensor).
"""
from __future__ import annotations

import json
import pathlib

import torch
import torch_xla

from portable_fsdp.errors import UserError

INDEX = "index.json"
REPLICATED = "{replicated}"  # the sharding spec of a tensor whole on every device


def _file(directory: pathlib.Path, device: str) -> pathlib.Path:
    """'TPU:5' -> device_00005.safetensors (the global device ordinal)."""
    return directory / f"device_{int(device.rsplit(':', 1)[1]):05d}.safetensors"


def save(tensors: dict, directory: pathlib.Path, write_index: bool) -> list:
    """Returns the files written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    values = [tensors[n] for n in names]
    per_device: dict = {}
    # Padded shards, as _load_local_shards takes them back.
    for name, shards in zip(names, torch_xla._XLAC._get_local_shards(values)):
        for data, device in shards:
            per_device.setdefault(device, {})[name] = data.contiguous()
    for device, blob in per_device.items():
        save_file(blob, _file(directory, device))
    written = [_file(directory, device) for device in per_device]
    if write_index:
        index = {name: {"shape": list(t.shape), "dtype": str(t.dtype),
                        "sharding": torch_xla._XLAC._get_xla_sharding_spec(t)} for name, t in tensors.items()}
        (directory / INDEX).write_text(json.dumps(index, indent=1))
        written.append(directory / INDEX)
    return written


def load(tensors: dict, directory: pathlib.Path) -> None:
    """Fill each (already sharded) device tensor in place with its shards from `directory`."""
    from safetensors import safe_open

    index = json.loads((directory / INDEX).read_text())
    for name, tensor in tensors.items():
        _check_same_layout(name, tensor, index.get(name))
    devices = torch_xla._XLAC._xla_get_runtime_devices()
    opened = [safe_open(str(_file(directory, d)), framework="pt") for d in devices]
    for name, tensor in tensors.items():
        shards = [f.get_tensor(name) for f in opened]
        if torch_xla._XLAC._get_xla_sharding_spec(tensor) == REPLICATED:
            _fill_replicated(tensor, shards[0])  # torch_xla loads the shards of split tensors only
        else:
            torch_xla._XLAC._load_local_shards(tensor, shards, devices)


def _fill_replicated(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """A tensor whole on every device (too small to split: portable_fsdp/placement.py) takes one device's copy,
    placed with the same annotation (an in-place copy would take the source's)."""
    placed = whole.to(tensor.device)
    torch_xla._XLAC._xla_mark_sharding(placed, torch_xla._XLAC._get_xla_op_sharding(tensor))
    tensor.data = placed


def _check_same_layout(name: str, tensor: torch.Tensor, saved: dict | None) -> None:
    if saved is None:
        raise UserError("train.resume", f"the sharded checkpoint has no tensor {name}; it was written for another model")
    now = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    if saved["shape"] != list(tensor.shape) or saved["sharding"] != now:
        raise UserError("train.resume", (
            f"{name} was saved as {saved['shape']} sharded {saved['sharding']}, and this run holds it as "
            f"{list(tensor.shape)} sharded {now}: a SHARDED_STATE_DICT checkpoint resumes on the same devices "
            "(--nproc) and plan; change them back, or save with plan.state_dict_type=FULL_STATE_DICT to move"))
