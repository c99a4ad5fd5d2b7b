"""Filling a model built on the meta device once FSDP has sharded it: from rank 0's weights
(hf_torch.model.create_model with `rank0_only`: `cpu_ram_efficient_loading`), or each rank its own shards of the
seeded random init or of a directory's safetensors files (hf_torch.model.create_on_meta)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE as CHECKPOINT_WRAPPED
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from portable_fsdp.backends.hf_torch.adapters import base_name


def broadcast_from_rank0(model, full_state_dict, parameters_on: torch.device, compute_on: torch.device) -> None:
    """After `fully_shard` of a meta-device model: allocate the shards on `parameters_on` (the host under
    plan.cpu_offload) and scatter rank 0's weights. Rank 0 keeps its real model (to_empty there would also wipe
    the buffers it is about to send). Buffers live where the model computes (`compute_on`) on every rank, as
    `fully_shard` put rank 0's: a broadcast's tensors must be on its process group's device."""
    if dist.get_rank() != 0:
        model.to_empty(device=parameters_on)
    place_buffers(model, compute_on)
    set_model_state_dict(model, full_state_dict if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    broadcast_computed_buffers(model)


def broadcast_computed_buffers(model) -> None:
    """Non-persistent buffers (e.g. rotary inv_freq) are in no state dict: rank 0 computed them, send them — by
    name, in one order on every rank (a set's order differs between processes: string hashes are salted, and two
    rotary tables of one shape, as Gemma 3's, would silently swap)."""
    for module in model.modules():
        for name in sorted(module._non_persistent_buffers_set):
            buffer = getattr(module, name)
            if buffer is not None:
                dist.broadcast(buffer, src=0)


def place_buffers(model, device: torch.device) -> None:
    """Every buffer of `model` onto `device`, parameters left where they are (FSDP2's CPU offload keeps the
    parameters in host memory and moves only them to the device, unit by unit, when a layer runs)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def materialize_shards(model, on_meta, parameters_on: torch.device, compute_on: torch.device) -> None:
    """After parallelizing a model built on the meta device (hf_torch.model.create_on_meta): allocate this
    rank's shards on `parameters_on` and fill them, one full parameter at a time on the CPU (the seeded init
    replayed, or read from the files), each rank keeping its own slice; then the computed buffers, on `compute_on`.
    No rank ever holds the whole model."""
    model.to_empty(device=parameters_on)
    place_buffers(model, compute_on)
    params = {_unwrapped_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}

    def deliver(names, full):
        for name in names:
            fill(params[name], full)

    on_meta.fill(deliver)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(on_meta.buffers[_unwrapped_name(name)])


def _unwrapped_name(name: str) -> str:
    """A parameter's name in the model as built (a checkpointed layer's sit inside its wrapper, an adapted
    Linear's inside peft's layer)."""
    return base_name(name.replace(CHECKPOINT_WRAPPED + ".", ""))


@torch.no_grad()
def fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """`param`'s piece of the full value: a DTensor's local shard (torch.chunk's split, FSDP2's and TP's), a
    plain tensor whole."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)
