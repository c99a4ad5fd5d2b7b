"""Writing and reading the torch backend's part of a checkpoint directory (layout: portable_fsdp.checkpointing).

FULL_STATE_DICT: rank 0 writes `model.safetensors` + `config.json` (a directory `from_pretrained` loads
outside FSDP) and `optimizer.pt`, gathered from every shard. SHARDED_STATE_DICT: every rank writes its
shards with torch.distributed.checkpoint under `sharded/`. Both add `rng/rank_*.pt` per rank.
"""
from __future__ import annotations

import dataclasses
import pathlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from portable_fsdp.backends.hf_torch.model import full_state_dict_with_ties
from portable_fsdp.backends.torch.tensor_parallel import sync_rng
from portable_fsdp import checkpointing
from portable_fsdp.plan import StateDictType

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(state, directory: pathlib.Path) -> None:
    """Every rank calls this; `directory` exists (rank 0 made it)."""
    directory = pathlib.Path(directory)
    rank = dist.get_rank()
    if state.ctx.plan.state_dict_type == StateDictType.FULL_STATE_DICT:
        model_sd = get_model_state_dict(state.model, options=FULL)
        optim_sd = get_optimizer_state_dict(state.model, state.optimizer, options=FULL)
        if rank == 0:
            # The model's own names (Mixtral's fused experts.gate_up_proj, not the hub's experts.N.w1): what
            # resume reads back on every backend; from_pretrained loads both.
            state.model.save_pretrained(directory, state_dict=model_sd, safe_serialization=True,
                                        save_original_format=False)
            torch.save(optim_sd, directory / checkpointing.OPTIMIZER)
    else:
        dcp.save({"model": get_model_state_dict(state.model), "optim": get_optimizer_state_dict(state.model, state.optimizer)},
                 checkpoint_id=str(directory / checkpointing.SHARDED))
        if rank == 0:
            state.model.config.save_pretrained(directory)
    rng_file = checkpointing.rng_file(directory, rank)
    rng_file.parent.mkdir(exist_ok=True)
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if state.ctx.runtime.device.type == "cuda" else None}, rng_file)


def load_checkpoint(state, directory: pathlib.Path, manifest: dict):
    """Restore weights, optimizer state, step and RNG; FULL checkpoints load at any world size."""
    directory = pathlib.Path(directory)
    if checkpointing.stored_layout(directory) == "FULL_STATE_DICT":
        _load_full(state, directory)
    else:
        _load_sharded(state, directory)
    rng_file = checkpointing.rng_file(directory, dist.get_rank())
    backend_name = state.ctx.runtime.device.type  # cpu or cuda: the name the run was started with
    if rng_file.exists() and checkpointing.restores_rng(manifest, backend_name, dist.get_world_size()):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # another backend or world size: a fresh, still deterministic stream per rank
        torch.manual_seed(checkpointing.resume_seed(state.ctx.config.seed, manifest["step"], dist.get_rank()))
    sync_rng(state.ctx.meshes.tp, state.ctx.runtime.device)
    return dataclasses.replace(state, step=manifest["step"])


def _load_full(state, directory: pathlib.Path) -> None:
    from safetensors.torch import load_file

    weights = full_state_dict_with_ties(state.model, load_file(directory / checkpointing.WEIGHTS))
    set_model_state_dict(state.model, weights, options=StateDictOptions(full_state_dict=True))
    optim_file = directory / checkpointing.OPTIMIZER
    if optim_file.exists():
        optim_sd = torch.load(optim_file, weights_only=False)
        set_optimizer_state_dict(state.model, state.optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))


def _load_sharded(state, directory: pathlib.Path) -> None:
    model_sd = get_model_state_dict(state.model)
    optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
    bundle = {"model": model_sd, "optim": optim_sd}
    dcp.load(bundle, checkpoint_id=str(directory / checkpointing.SHARDED))
    set_model_state_dict(state.model, bundle["model"])
    set_optimizer_state_dict(state.model, state.optimizer, bundle["optim"])
