"""Filling a model built on the meta device (hf_torch.model.create_model with `rank0_only`) from rank 0's
weights once FSDP has sharded it (`cpu_ram_efficient_loading`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def broadcast_from_rank0(model, full_state_dict, device: torch.device) -> None:
    """After `fully_shard` of a meta-device model: allocate the shards and scatter rank 0's weights.
    Rank 0 keeps its real model (to_empty there would also wipe the buffers it is about to send)."""
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_state_dict if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (e.g. rotary inv_freq) are in no state dict: rank 0 computed them, send them.
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = getattr(module, name)
            if buffer is not None:
                dist.broadcast(buffer, src=0)
