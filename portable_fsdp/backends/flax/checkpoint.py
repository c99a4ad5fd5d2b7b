"""Checkpoints of the Flax lowering (layout: portable_fsdp.checkpoint.layout; which files each process writes, and in
which order: portable_fsdp.checkpoint.files, given this module's `_writer`).

FULL_STATE_DICT, in the torch backends' format: `model.safetensors` (or shards of train.max_shard_size +
model.safetensors.index.json, in train.save_dtype) + `config.json` + `generation_config.json`: a directory
`from_pretrained` loads, and that every backend resumes from; written one parameter at a time. `optimizer.pt`:
AdamW's state as torch's full optimizer state dict (`{"state": {torch name: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [...]}`), moments in torch's layout, so a run can resume on another backend.
A user's flax.nnx model (user_model.py) is saved by its parameters' dotted paths as they are, without config.json;
with it or with a user's optax transformation, `optimizer.pt` holds the optax state's own arrays
(`{"optax_state": {path: array}}`): this backend resumes them bit for bit, with the same optimizer.
SHARDED_STATE_DICT: `sharded/`, orbax's files, each process writing its own shards (sharded.py), beside
`config.json` and `generation_config.json`; resumes on this backend only, at any device count or mesh.
Training draws no random numbers: there is no RNG to save.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from portable_fsdp.backends.flax import torch_weights, optimizer as optimizer_lib, processes, sharded
from portable_fsdp.backends.flax.sharding import place, place_all
from portable_fsdp.checkpoint import files as checkpoint_files, layout as checkpointing, safetensors_shards
from portable_fsdp.backends.flax.step import TrainState
from portable_fsdp.errors import UserError
from portable_fsdp.plan import StateDictType


def save_checkpoint(state: TrainState, directory: pathlib.Path):
    """Every process; `directory` exists (process 0 made it). FULL: every process gathers each weight and the
    moments (collectives); the weights' shard files are written by the process owning each, the rest by process 0.
    SHARDED: every process writes its own shards (sharded.py; a future of its files with train.async_save).
    Returns {path: checksum or None} of the files this process wrote. Which files: portable_fsdp.checkpoint.files."""
    return checkpoint_files.write(_writer(state), directory)


def export_weights(state: TrainState, directory: pathlib.Path) -> dict:
    """The weights and model config of a FULL checkpoint, without the optimizer state (train.export_full_at_end,
    at the end of a SHARDED run)."""
    return checkpoint_files.write_export(_writer(state), directory)


def _writer(state: TrainState) -> checkpoint_files.Writer:
    """This backend's writers of `state` (no RNG: training draws no random numbers)."""
    return checkpoint_files.Writer(
        rank=jax.process_index(), full=state.ctx.plan.state_dict_type == StateDictType.FULL_STATE_DICT,
        weights=functools.partial(_save_weights, state),
        optimizer_state=_optimizer_state_writer(state),
        model_config=lambda directory, full: _model_config(state, directory),
        sharded=functools.partial(sharded.save, state), torch_save=_torch_save)


def _model_config(state: TrainState, directory: pathlib.Path) -> dict:
    """config.json and generation_config.json, the same beside FULL weights and SHARDED files (see
    _write_hf_config); {path: None} of them. Neither for a user's model: it has no transformers config."""
    ctx = state.ctx
    if ctx.hf_config is None:
        return {}
    _write_hf_config(ctx.hf_config, ctx.info.root_class, directory, ctx.config.train.save_dtype)
    return {directory / name: None for name in ("config.json", "generation_config.json")}


def _torch_save(obj, file) -> None:
    import torch  # optimizer.pt is torch's format: imported by FULL saves only

    torch.save(obj, file)


def _save_weights(state: TrainState, directory: pathlib.Path) -> dict:
    """The weights in torch's names and layout (no tied lm_head; a user's model: its own, model_def.saved_name), in
    train.save_dtype, in shards of train.max_shard_size as save_pretrained writes them: one parameter on the host at
    a time."""
    train, model_def = state.ctx.config.train, state.ctx.model_def
    flax_of = {model_def.saved_name(n): n for n in state.params}
    order = [n for n in state.ctx.torch_names if n in flax_of] + sorted(set(flax_of) - set(state.ctx.torch_names))
    stored = {n: train.save_dtype if jnp.issubdtype(state.params[flax_of[n]].dtype, jnp.floating)
              else str(state.params[flax_of[n]].dtype) for n in order}
    entries = [safetensors_shards.Tensor(n, stored[n], _saved_shape(model_def, flax_of[n],
                                                                     state.params[flax_of[n]].shape)) for n in order]
    writer = safetensors_shards.Writer(directory, entries, safetensors_shards.parse_size(train.max_shard_size),
                                       jax.process_index(), jax.process_count())
    for name in order:
        host = _to_host({name: state.params[flax_of[name]]})[name]  # several processes: a collective
        if writer.owner(name) == jax.process_index():
            array = model_def.saved_layout(flax_of[name], host).astype(_numpy_dtype(stored[name]))
            writer.write(name, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return writer.close()


def _saved_shape(model_def, flax_name: str, shape) -> tuple:
    """The saved layout's shape, from a zero-stride view (no memory)."""
    return tuple(model_def.saved_layout(flax_name, np.broadcast_to(np.zeros((), np.uint8), shape)).shape)


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def load_checkpoint(state: TrainState, directory: pathlib.Path, manifest: dict) -> TrainState:
    """Weights and AdamW's state, at any device count or mesh: of a FULL checkpoint (the optimizer's when it has
    optimizer.pt), or of a SHARDED one this backend wrote (others are refused before: checkpointing.check_compatible)."""
    directory = pathlib.Path(directory)
    if checkpointing.stored_layout(directory) == "SHARDED_STATE_DICT":
        params, opt_state = sharded.load(state, directory)
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=manifest["step"])
    ctx = state.ctx
    host = ctx.model_def.read_saved(directory)
    # a bfloat16 export (train.save_dtype) resumes into the training dtype
    host = {name: value.astype(state.params[name].dtype) for name, value in host.items()}
    params = place_all(host, ctx.param_sharding)
    opt_state = state.opt_state
    if (directory / checkpointing.OPTIMIZER).exists() and _portable_state(state):
        opt_state = _load_torch_optimizer_state(state, directory / checkpointing.OPTIMIZER)
    elif (directory / checkpointing.OPTIMIZER).exists() and not ctx.torch_optimizer_state:
        opt_state = _load_optax_state(state, directory / checkpointing.OPTIMIZER)
    return dataclasses.replace(state, params=params, opt_state=opt_state, step=manifest["step"])


def _to_host(tree: dict) -> dict:
    if processes.several():  # arrays sharded over machines: gathered whole on every process
        return {name: np.asarray(value) for name, value in processes.gather(tree).items()}
    return {name: np.asarray(jax.device_get(value)) for name, value in tree.items()}


def _write_hf_config(hf_config, model_class: str, directory: pathlib.Path, dtype: str) -> None:
    """What save_pretrained writes besides the weights: config.json (with the class to build, e.g.
    MixtralForCausalLM, and the weights' dtype) and generation_config.json."""
    from transformers import GenerationConfig

    config = copy.deepcopy(hf_config)
    config.architectures = [model_class]
    config.dtype = dtype
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)


def _portable_state(state: TrainState) -> bool:
    """Whether FULL checkpoints carry the optimizer's state as torch's: the built-in AdamW's only
    (docs/capabilities.md)."""
    return state.ctx.torch_optimizer_state and state.ctx.config.train.optimizer == "adamw"


def _optimizer_state_writer(state: TrainState):
    """What gathers optimizer.pt's content: torch's AdamW state dict, a user's optimizer or model's optax arrays,
    or None (a named optimizer other than AdamW: a resume restarts it)."""
    if _portable_state(state):
        return functools.partial(_torch_optimizer_state, state)
    if not state.ctx.torch_optimizer_state:
        return functools.partial(_optax_state, state)
    return None


def _optax_state(state: TrainState) -> dict:
    """{"optax_state": {path: numpy array}}: every array of the optax state, whole, by its path in the tree."""
    leaves = jax.tree_util.tree_leaves_with_path(state.opt_state)
    return {"optax_state": _to_host({jax.tree_util.keystr(path): leaf for path, leaf in leaves})}


def _another_optimizer(path: pathlib.Path) -> UserError:
    return UserError("train.resume", (f"{path} holds the state of another optimizer or model; resume with the "
                                      "optimizer and model it was saved with, or start a new --workdir"))


def _load_optax_state(state: TrainState, path: pathlib.Path):
    """The optax state `_optax_state` saved, placed as this state's is; one line when it is another optimizer's."""
    import torch

    saved = torch.load(path, weights_only=False).get("optax_state", {})
    paths, structure = jax.tree_util.tree_flatten_with_path(state.opt_state)
    names = [jax.tree_util.keystr(p) for p, _ in paths]
    if sorted(names) != sorted(saved) or any(saved[n].shape != leaf.shape for n, (_, leaf) in zip(names, paths)):
        raise _another_optimizer(path)
    host = jax.tree_util.tree_unflatten(structure, [saved[n] for n in names])
    return jax.tree.map(place, host, state.ctx.opt_sharding)


def _param_groups(state: TrainState, names_in_torch_order: list) -> list:
    t = state.ctx.config.train
    lr = float(state.ctx.schedule(max(state.step - 1, 0)))  # the rate of the last step taken, as torch's group holds
    decays = {torch_weights.torch_name(n): flag for n, flag in optimizer_lib.decays(state.params).items()}
    common = {"lr": lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "amsgrad": False, "maximize": False,
              "foreach": False, "capturable": False, "differentiable": False, "fused": False,
              "decoupled_weight_decay": True}
    return [{"weight_decay": t.weight_decay, **common, "params": [n for n in names_in_torch_order if decays[n]]},
            {"weight_decay": 0.0, **common, "params": [n for n in names_in_torch_order if not decays[n]]}]


def _torch_optimizer_state(state: TrainState) -> dict:
    import torch

    arch = state.ctx.model_def.arch
    count, mu, nu = optimizer_lib.adam_moments(state.opt_state)
    exp_avg = torch_weights.to_torch(_to_host(mu), arch, with_tied_head=False)
    exp_avg_sq = torch_weights.to_torch(_to_host(nu), arch, with_tied_head=False)
    names = [n for n in state.ctx.torch_names if n in exp_avg]  # torch's order; a tied head has no state
    step = torch.tensor(float(count))
    per_param = {n: {"step": step.clone(), "exp_avg": exp_avg[n], "exp_avg_sq": exp_avg_sq[n]} for n in names}
    return {"state": per_param, "param_groups": _param_groups(state, names)}


def _load_torch_optimizer_state(state: TrainState, path: pathlib.Path):
    import torch

    ctx = state.ctx
    saved = torch.load(path, weights_only=False)
    if "state" not in saved:  # a user's optimizer's optax arrays
        raise _another_optimizer(path)
    per_param = saved["state"]
    names = list(ctx.model_def.variables)
    if not per_param:  # saved before the first step: nothing to restore
        return state.opt_state
    arch = ctx.model_def.arch
    mu = torch_weights.from_torch({k: v["exp_avg"] for k, v in per_param.items()}, names, arch, "train.resume")
    nu = torch_weights.from_torch({k: v["exp_avg_sq"] for k, v in per_param.items()}, names, arch, "train.resume")
    count = int(next(iter(per_param.values()))["step"].item())
    moment_sharding = {n: ctx.param_sharding[n] for n in names}
    opt_state = optimizer_lib.replace_adam_moments(state.opt_state, jnp.asarray(count, jnp.int32),
                                                   place_all(mu, moment_sharding), place_all(nu, moment_sharding))
    return jax.device_put(opt_state, ctx.opt_sharding)
