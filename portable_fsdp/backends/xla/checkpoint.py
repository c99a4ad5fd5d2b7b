"""Writing and reading the xla backend's part of a checkpoint directory (layout: portable_fsdp.checkpoint.layout;
which files each process writes, and in which order: portable_fsdp.checkpoint.files, given this module's
`_writer`), in the torch backend's formats so a checkpoint moves between backends:

FULL_STATE_DICT: every shard is gathered (not only the first process's), one parameter at a time, into
`model.safetensors` (or shards of train.max_shard_size + index, in train.save_dtype: safetensors_shards) +
`config.json` + `generation_config.json` (what `from_pretrained` and --backend cpu load) and `optimizer.pt`
(torch's full optimizer state dict: state and param_groups keyed by parameter name).
SHARDED_STATE_DICT: per-shard files under `sharded/`: one per device under SPMD (see shard_files), one per
process under FSDP v1. Both add `rng/rank_*.pt` per process.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

import torch
import torch_xla.core.xla_model as xm

from portable_fsdp.backends.hf_torch import export
from portable_fsdp.backends.xla import full_state, runtime as rt, shard_files
from portable_fsdp.checkpoint import files as checkpoint_files, layout as checkpointing, safetensors_shards
from portable_fsdp.errors import UserError
from portable_fsdp.plan import StateDictType

MOMENTS = ("exp_avg", "exp_avg_sq")


def save_checkpoint(state, directory: pathlib.Path):
    """Every process calls this; `directory` exists (process 0 made it). Returns {path: checksum or None} of the
    files this process wrote. Which files: portable_fsdp.checkpoint.files."""
    rt.sync()  # the weights read are those of the last finished step
    return checkpoint_files.write(_writer(state), directory)


def export_weights(state, directory: pathlib.Path) -> dict:
    """Every process: the FULL checkpoint's weights and model config, no optimizer state
    (train.export_full_at_end: the export of a SHARDED run). Returns {path: checksum or None} of its files."""
    rt.sync()
    return checkpoint_files.write_export(_writer(state), directory)


def _writer(state) -> checkpoint_files.Writer:
    """This backend's writers of `state`."""
    ctx = state.ctx
    return checkpoint_files.Writer(
        rank=ctx.runtime.rank, full=ctx.plan.state_dict_type == StateDictType.FULL_STATE_DICT,
        weights=functools.partial(_save_full_weights, state),
        optimizer_state=functools.partial(_full_optimizer_state, state) if _portable_state(state) else None,
        model_config=lambda directory, full: export.model_config(ctx.hf_model, ctx.info.root_class, directory,
                                                                 ctx.config.train.save_dtype, full),
        sharded=functools.partial(_save_sharded, state), torch_save=torch.save,
        rng_state=lambda: {"cpu": torch.get_rng_state(), "cuda": None, "xla": xm.get_rng_state()})


def _save_full_weights(state, directory: pathlib.Path) -> dict:
    """The weights in safetensors shards as save_pretrained names them (the model's own names: Mixtral's fused
    experts.gate_up_proj, which resume reads on every backend), gathered one parameter at a time (every shard,
    not only the first process's; a collective under FSDP v1) and written by the process owning its file."""
    ctx, train = state.ctx, state.ctx.config.train
    buffers = full_state.persistent_buffers(ctx.hf_model)
    entries = [export.entry(n.name, n.param, n.shape, train.save_dtype) for n in ctx.named]
    entries += [export.entry(name, b, b.shape, train.save_dtype) for name, b in buffers.items()]
    writer = safetensors_shards.Writer(directory, entries, safetensors_shards.parse_size(train.max_shard_size),
                                       ctx.runtime.rank, ctx.runtime.process_count)
    for n in ctx.named:  # a fixed order: under FSDP v1 every gather is a collective
        full = full_state.gather(ctx.runtime, n.param, n.shape)
        if writer.owner(n.name) == ctx.runtime.rank:
            writer.write(n.name, export.host_bytes(full, train.save_dtype))
    for name, buffer in buffers.items():
        if writer.owner(name) == ctx.runtime.rank:
            writer.write(name, export.host_bytes(buffer, train.save_dtype))
    return writer.close()


def load_checkpoint(state, directory: pathlib.Path, manifest: dict):
    """Restore weights, optimizer state, step and RNG; FULL checkpoints load at any device count and from
    any backend (which SHARDED ones load where: checkpointing.check_compatible, before this)."""
    directory = pathlib.Path(directory)
    if checkpointing.stored_layout(directory) == "FULL_STATE_DICT":
        _load_full(state, directory)
    else:
        _load_sharded(state, directory / checkpointing.SHARDED)
    _restore_rng(state, directory, manifest)
    rt.sync()
    return dataclasses.replace(state, step=manifest["step"])


def _portable_state(state) -> bool:
    """Whether FULL checkpoints carry the optimizer's state: AdamW's only, whose moments are gathered and placed
    like their parameters (docs/capabilities.md; SHARDED ones are refused for the others)."""
    return state.ctx.config.train.optimizer == "adamw" and not state.ctx.own_optimizer


def _full_optimizer_state(state) -> dict:
    """torch's FULL optimizer state dict: {"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}."""
    ctx, optimizer = state.ctx, state.optimizer
    names = {id(n.param): n.name for n in ctx.named}
    saved = {}
    for n in ctx.named:  # a fixed order: under FSDP v1 every gather is a collective
        per_param = optimizer.state.get(n.param, {})
        if per_param:
            saved[n.name] = {"step": per_param["step"].detach().clone(),
                             **{k: full_state.gather(ctx.runtime, per_param[k], n.shape) for k in MOMENTS}}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": saved, "param_groups": groups}


def _load_full(state, directory: pathlib.Path) -> None:
    """The weights read one tensor at a time from the files (through the index when split), each placed like the
    parameter it fills (cast to its dtype: a bfloat16 export resumes into fp32 weights)."""
    from safetensors import safe_open

    ctx = state.ctx
    by_name = {n.name: n for n in ctx.named}
    found = set()
    with torch.no_grad():
        for file in safetensors_shards.weight_files(directory, "train.resume"):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in by_name:
                        n = by_name[key]
                        export.require_shape(directory, key, f.get_slice(key).get_shape(), n.shape)
                        n.param.data = full_state.place(ctx.runtime, n.param, f.get_tensor(key))
                        found.add(key)
    missing = [name for name in by_name if name not in found]
    if missing:
        raise UserError("train.resume", f"the weights in {directory} lack {', '.join(missing[:3])}: another model")
    optim_file = directory / checkpointing.OPTIMIZER
    if optim_file.exists() and _portable_state(state):
        saved = torch.load(optim_file, weights_only=False)["state"]
        for n in ctx.named:
            if n.name in saved:
                _set_moments(state, n.param, saved[n.name],
                             lambda like, full: full_state.place(ctx.runtime, like, full))


def _set_moments(state, param, saved: dict, place) -> None:
    """Replace AdamW's (primed) state of `param`; `place(like, value)` lays a saved tensor out like `like`."""
    current = state.optimizer.state[param]
    current["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone()
    for key in MOMENTS:
        current[key] = place(current[key], saved[key])


def _save_sharded(state, directory: pathlib.Path) -> dict:
    """Returns {path: None} of the files this process wrote."""
    ctx, optimizer = state.ctx, state.optimizer
    directory.mkdir(parents=True, exist_ok=True)
    steps = {n.name: optimizer.state[n.param]["step"] for n in ctx.named if optimizer.state.get(n.param)}
    if ctx.runtime.spmd:
        written = dict.fromkeys(shard_files.save(_device_tensors(state), directory, write_index=ctx.runtime.rank == 0))
        if ctx.runtime.rank == 0:
            torch.save({"step": steps}, directory / "optimizer_steps.pt")
            written[directory / "optimizer_steps.pt"] = None
        return written
    # FSDP v1: each process's flat shards, in one file per process.
    shards = {"world_size": ctx.runtime.world_size,
              "model": {n.name: n.param.detach().cpu() for n in ctx.named},
              "optim": {n.name: {"step": steps[n.name], **{k: optimizer.state[n.param][k].cpu() for k in MOMENTS}}
                        for n in ctx.named if n.name in steps}}
    torch.save(shards, directory / f"rank_{ctx.runtime.rank:05d}.pt")
    return {directory / f"rank_{ctx.runtime.rank:05d}.pt": None}


def _device_tensors(state) -> dict:
    """Every sharded device tensor of the training state, by checkpoint name."""
    tensors = {f"model.{n.name}": n.param for n in state.ctx.named}
    for n in state.ctx.named:
        for key in MOMENTS:
            if key in state.optimizer.state.get(n.param, {}):
                tensors[f"optim.{n.name}.{key}"] = state.optimizer.state[n.param][key]
    return tensors


def _load_sharded(state, directory: pathlib.Path) -> None:
    ctx = state.ctx
    if ctx.runtime.spmd:
        if not (directory / shard_files.INDEX).exists():
            raise UserError("train.resume", f"{directory} was written by FSDP v1; resume it with plan.xla_fsdp_v2=false")
        shard_files.load(_device_tensors(state), directory)
        steps = torch.load(directory / "optimizer_steps.pt", weights_only=False)["step"]
        for n in ctx.named:
            state.optimizer.state[n.param]["step"] = steps[n.name].detach().clone()
        return
    path = directory / f"rank_{ctx.runtime.rank:05d}.pt"
    if not path.exists():
        raise UserError("train.resume", f"{path} is missing: written by SPMD FSDPv2 or by fewer processes")
    shards = torch.load(path, weights_only=False)
    if shards["world_size"] != ctx.runtime.world_size:
        raise UserError("train.resume", (
            f"written by {shards['world_size']} FSDP v1 processes, resumed by {ctx.runtime.world_size}: a "
            "SHARDED_STATE_DICT checkpoint resumes at the same size; use FULL_STATE_DICT to change it"))
    with torch.no_grad():
        for n in ctx.named:
            n.param.data = shards["model"][n.name].to(ctx.runtime.device)
            if n.name in shards["optim"]:
                _set_moments(state, n.param, shards["optim"][n.name], lambda like, t: t.to(ctx.runtime.device))


def _restore_rng(state, directory: pathlib.Path, manifest: dict) -> None:
    rank = state.ctx.runtime.rank
    rng_file = checkpointing.rng_file(directory, rank)
    if rng_file.exists() and checkpointing.restores_rng(manifest, "xla", state.ctx.runtime.world_size):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        xm.set_rng_state(rng["xla"])
    else:  # another layout or backend: a fresh, still deterministic stream per process
        seed = checkpointing.resume_seed(state.ctx.config.seed, manifest["step"], rank)
        torch.manual_seed(seed)
        xm.set_rng_state(seed)
