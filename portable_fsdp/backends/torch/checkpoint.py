"""Writing and reading the torch backend's part of a checkpoint directory (layout: portable_fsdp.checkpoint.layout;
which files each rank writes, and in which order: portable_fsdp.checkpoint.files, given this module's `_writer`).

FULL_STATE_DICT: the weights as `save_pretrained` writes them (model.safetensors, or shards of at most
train.max_shard_size + model.safetensors.index.json, in train.save_dtype) + config.json + generation_config.json,
a directory `from_pretrained` loads outside FSDP; streamed: each parameter is gathered in turn (`full_tensor`, a
collective), and the rank owning its shard file copies it to the CPU and appends it to the file, hashing it on the
way; no rank ever holds the whole model. `optimizer.pt`: torch's full optimizer state dict, gathered to rank 0's
CPU. SHARDED_STATE_DICT: every rank writes its shards with torch.distributed.checkpoint under `sharded/`
(sharded_writer; in a writer process of its own with train.async_save: save_process), read back through
`checkpoint_reader.Reader` (each tensor's bytes straight into place). Both: `rng/rank_*.pt`, torch's CPU (and CUDA)
RNG state per rank.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import pathlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from portable_fsdp.backends.hf_torch import adapters, export
from portable_fsdp.backends.torch import distributed, save_process, sharded_writer
from portable_fsdp.backends.torch.dtensors import full_value
from portable_fsdp.backends.torch.checkpoint_reader import Reader
from portable_fsdp.backends.torch.model import fill
from portable_fsdp.backends.torch.tensor_parallel import sync_rng
from portable_fsdp.checkpoint import files as checkpoint_files, layout as checkpointing, safetensors_shards
from portable_fsdp.errors import UserError
from portable_fsdp.plan import StateDictType

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(state, directory: pathlib.Path):
    """Every rank calls this; `directory` exists (rank 0 made it). Returns {path: checksum or None} of this
    rank's files (a future of them with train.async_save: SHARDED only). Which files: portable_fsdp.checkpoint.files."""
    return checkpoint_files.write(_writer(state), directory)


def export_weights(state, directory: pathlib.Path) -> dict:
    """Every rank: the FULL checkpoint's weights and model config, no optimizer state (train.export_full_at_end:
    the export of a SHARDED run). Returns {path: checksum or None} of this rank's files."""
    return checkpoint_files.write_export(_writer(state, export_merged=True), directory)


def _writer(state, export_merged: bool = False) -> checkpoint_files.Writer:
    """This backend's writers of `state`. With model.peft a checkpoint's weights are the adapters alone (the base
    is rebuilt from where it came from: model.init_from or the seeded init); an export merges them into the base."""
    train, cuda = state.ctx.config.train, state.ctx.runtime.device.type == "cuda"
    adapted = adapters.present(state.model) and not export_merged

    def weights(directory):
        return save_adapters(state.model, directory) if adapted else save_full_weights(state.model, directory, train)

    def model_config(directory, full):
        written = export.model_config(state.model, state.ctx.info.root_class, directory, train.save_dtype, full)
        if adapted:
            written.update(adapters.write_config(state.ctx.config.model.peft, directory,
                                                 state.ctx.config.model.init_from))
        return written

    return checkpoint_files.Writer(
        rank=dist.get_rank(), full=state.ctx.plan.state_dict_type == StateDictType.FULL_STATE_DICT,
        weights=weights,
        optimizer_state=lambda: get_optimizer_state_dict(state.model, state.optimizer, options=FULL),  # rank 0's CPU
        model_config=model_config,
        sharded=functools.partial(_save_sharded, state), torch_save=torch.save,
        rng_state=lambda: {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if cuda else None})


def _save_sharded(state, sharded: pathlib.Path):
    """torch.distributed.checkpoint's files; with train.async_save, a future of them: the state is copied to host
    memory in a thread while the next step computes its gradients (the step waits for the copy before its update:
    `staged`), then written by this rank's writer process while training goes on."""
    bundle = {"model": _saved_model_state(state.model), "optim": get_optimizer_state_dict(state.model, state.optimizer)}
    # peft's files of the adapters too, beside sharded/ (small: gathered whole)
    peft_files = save_adapters(state.model, sharded.parent) if adapters.present(state.model) else {}

    if not state.ctx.config.train.async_save:
        # dcp's own collectives wait for the slowest rank's write: give them the save's bound, not the default's
        return {**peft_files, **sharded_writer.save(bundle, sharded, dist.get_rank(),
                                                    distributed.slow_group(_io_timeout(state)))}
    # the copy into host memory overlaps the next step's forward and backward: only its update must wait (`staged`)
    staging = _staging_thread(state.ctx.runtime.device).submit(_stager(state.ctx.runtime.device.type).stage, bundle)
    _staging.append(staging)
    return checkpoint_files.joined(peft_files, save_process.submit(staging, str(sharded), _io_timeout(state)))


def _saved_model_state(model) -> dict:
    """The model's part of a SHARDED checkpoint: every parameter's shards, or with model.peft the adapters' (the
    frozen base is rebuilt from where it came from)."""
    state = get_model_state_dict(model)
    if not adapters.present(model):
        return state
    return {name: tensor for name, tensor in state.items() if adapters.is_adapter(name)}


_staging: list = []  # the copy of a background save's state still being made


def staged() -> None:
    """Before the parameters or the optimizer state change (the training step's update): the copy of them that a
    background save is making is complete; its error, if it had one, is raised here."""
    while _staging:
        _staging.pop(0).result()


@functools.cache
def _staging_thread(device: torch.device) -> concurrent.futures.ThreadPoolExecutor:
    """The thread copying a background save's state to host memory. The CUDA current device is per thread: pinning
    host memory from a thread that never chose one opens a CUDA context on GPU 0 (every rank's, on rank 0's GPU),
    so the thread takes its rank's device first."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-staging",
                                                 initializer=distributed.use_device, initargs=(device,))


@functools.cache
def _stager(device_type: str) -> DefaultStager:
    """One per process: the host copies of this rank's shards (pinned on CUDA), in shared memory for the writer
    process (save_process), are allocated at the first background save and refilled at the next ones."""
    return DefaultStager(StagingOptions(use_pinned_memory=device_type == "cuda", use_shared_memory=True,
                                        use_async_staging=False, use_non_blocking_copy=False))


def _io_timeout(state) -> float:
    return checkpointing.wait_bound_s(state.ctx.info.n_params, state.ctx.config.train.collective_timeout_s)


def save_full_weights(model, directory: pathlib.Path, train) -> dict:
    """Every rank: the model's weights into safetensors shards (see the module's docstring), one parameter at a
    time; with model.peft's adapters, merged into the weights they adapt (merge_and_unload's). Returns {path:
    checksum} of the shards this rank wrote (rank 0: and the index)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    skip = export.tied_copies(model)
    state = get_model_state_dict(model)  # shards: nothing gathered
    local = {adapters.base_name(n): (n, t) for n, t in state.items() if n not in skip and not adapters.is_adapter(n)}
    partners = adapters.merge_partners(model) if adapters.present(model) else {}  # peft is an extra: only then
    writer = safetensors_shards.Writer(
        directory, [export.entry(n, t, t.shape, train.save_dtype) for n, (_, t) in local.items()],
        safetensors_shards.parse_size(train.max_shard_size), rank, world)
    for name, (key, tensor) in local.items():
        full = full_value(tensor)  # a collective: every rank (an offloaded shard gathered on its mesh's device)
        if key in partners:
            lora_a, lora_b, scale = partners[key]
            full = adapters.merged_weight(full, full_value(state[lora_a]), full_value(state[lora_b]), scale)
        if writer.owner(name) == rank:
            writer.write(name, export.host_bytes(full, train.save_dtype))
        del full
    return writer.close()


def save_adapters(model, directory: pathlib.Path) -> dict:
    """Every rank (each adapter gathered whole in turn, a collective); rank 0 writes peft's
    adapter_model.safetensors. Returns {path: None} of what this rank wrote."""
    gathered = {n: full_value(t).cpu() for n, t in get_model_state_dict(model).items() if adapters.is_adapter(n)}
    return adapters.write_weights(gathered, directory) if dist.get_rank() == 0 else {}


def load_adapters(model, directory: pathlib.Path) -> None:
    """Every rank: its slice of each adapter from peft's adapter_model.safetensors (the base stays as built)."""
    stored = adapters.read_weights(directory)
    for name, param in model.named_parameters():
        clean = export.clean_name(name)
        if adapters.is_adapter(clean):
            key = adapters.peft_key(clean)
            if key not in stored:
                raise UserError("train.resume", f"the adapters in {directory} lack {key}: another model.peft")
            fill(param, stored[key])


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
    if adapters.present(state.model):
        load_adapters(state.model, directory)
    else:
        load_full_weights(state.model, directory)
    optim_file = directory / checkpointing.OPTIMIZER
    if optim_file.exists():
        # mapped, not read: each rank reads only the rows of its own shards
        load_full_optimizer_state(state.model, state.optimizer, torch.load(optim_file, weights_only=False, mmap=True))


def load_full_optimizer_state(model, optimizer, full: dict) -> None:
    """torch's full optimizer state dict into this rank's shards, each rank slicing its own part of every moment
    (set_optimizer_state_dict(full_state_dict=True) scatters every tensor from rank 0 instead: one collective per
    moment, ~40% of a FULL resume on gloo)."""
    sharded = get_optimizer_state_dict(model, optimizer)  # this rank's shards, keyed by parameter name
    for name, per_param in sharded["state"].items():
        saved = full["state"].get(name)
        if saved is None:
            raise UserError("train.resume", f"the optimizer state in the checkpoint lacks {name}: another model or "
                            "another set of trainable parameters (train.freeze)")
        for key, value in per_param.items():
            if isinstance(value, DTensor):
                fill(value, saved[key])
            elif torch.is_tensor(value):
                with torch.no_grad():
                    value.copy_(saved[key])
            else:
                per_param[key] = saved[key]
    sharded["param_groups"] = full["param_groups"]
    set_optimizer_state_dict(model, optimizer, sharded)


def load_full_weights(model, directory: pathlib.Path) -> None:
    """Every rank reads the weight files (through the index when split) one tensor at a time and keeps its own
    slice of each, cast to the parameter's dtype (a bfloat16 export resumes into fp32 weights)."""
    from safetensors import safe_open

    targets: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        targets.setdefault(export.clean_name(name), []).append(param)
    buffers = {export.clean_name(n): b for n, b in model.named_buffers()}
    found = set()
    for file in safetensors_shards.weight_files(directory, "train.resume"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in targets:
                    export.require_shape(directory, key, f.get_slice(key).get_shape(), targets[key][0].shape)
                    for param in targets[key]:
                        fill(param, f.get_tensor(key))
                elif key in buffers:
                    with torch.no_grad():
                        buffers[key].copy_(f.get_tensor(key))
                found.add(key)
    # tied copies are left out of the files: they are the parameter they are tied to, filled above
    tied = export.tied_copies(model)
    missing = [n for n in targets if n not in found and n not in tied]
    if missing:
        raise UserError("train.resume", f"the weights in {directory} lack {', '.join(missing[:3])}: another model")


def _load_sharded(state, directory: pathlib.Path) -> None:
    model_sd = _saved_model_state(state.model)
    optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
    bundle = {"model": model_sd, "optim": optim_sd}
    # dcp's collectives wait for the slowest rank's read: give them the load's bound, not the default's
    dcp.load(bundle, storage_reader=Reader(directory / checkpointing.SHARDED),
             process_group=distributed.slow_group(_io_timeout(state)))
    set_model_state_dict(state.model, bundle["model"], options=StateDictOptions(strict=not adapters.present(state.model)))
    set_optimizer_state_dict(state.model, state.optimizer, bundle["optim"])
