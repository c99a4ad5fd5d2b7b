"""FULL checkpoints of the Flax lowering, in the torch backends' format (layout: portable_fsdp.checkpointing).

`model.safetensors` + `config.json` + `generation_config.json`: a directory `from_pretrained` loads, and
that every backend resumes from. `optimizer.pt`: AdamW's state as torch's full optimizer state dict
(`{"state": {torch name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}`), moments in torch's
layout, so a run can resume on another backend. Training draws no random numbers: there is no RNG to save.
"""
from __future__ import annotations

import copy
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from portable_fsdp.backends.flax import convert, optimizer as optimizer_lib, processes
from portable_fsdp.backends.flax.sharding import place_all
from portable_fsdp import checkpointing
from portable_fsdp.backends.flax.step import TrainState



def save_checkpoint(state: TrainState, directory: pathlib.Path) -> None:
    """Several processes: every one gathers the weights and moments (a collective), process 0 alone writes."""
    directory = pathlib.Path(directory)
    arch = state.ctx.model_def.arch
    weights, optimizer_state = _to_host(state.params), _torch_optimizer_state(state)
    if jax.process_index() != 0:
        return
    convert.write_safetensors(weights, arch, directory / checkpointing.WEIGHTS)
    _write_hf_config(state.ctx.hf_config, state.ctx.info.root_class, directory)
    import torch

    torch.save(optimizer_state, directory / checkpointing.OPTIMIZER)


def load_checkpoint(state: TrainState, directory: pathlib.Path, manifest: dict) -> TrainState:
    """Weights (and AdamW's state when present) of a FULL checkpoint, at any device count."""
    directory = pathlib.Path(directory)
    checkpointing.stored_layout(directory)  # SHARDED ones are refused before (checkpointing.check_compatible)
    ctx = state.ctx
    host = convert.read_safetensors_dir(directory, ctx.model_def.variables, ctx.model_def.arch)
    params = place_all(host, ctx.param_sharding)
    opt_state = state.opt_state
    if (directory / checkpointing.OPTIMIZER).exists():
        opt_state = _load_torch_optimizer_state(state, directory / checkpointing.OPTIMIZER)
    return dataclasses.replace(state, params=params, opt_state=opt_state, step=manifest["step"])


def _to_host(tree: dict) -> dict:
    if processes.several():  # arrays sharded over machines: gathered whole on every process
        return {name: np.asarray(value) for name, value in processes.gather(tree).items()}
    return {name: np.asarray(jax.device_get(value)) for name, value in tree.items()}


def _write_hf_config(hf_config, model_class: str, directory: pathlib.Path) -> None:
    """What save_pretrained writes besides the weights: config.json (with the class to build, e.g.
    MixtralForCausalLM) and generation_config.json."""
    from transformers import GenerationConfig

    config = copy.deepcopy(hf_config)
    config.architectures = [model_class]
    config.dtype = "float32"
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)


def _param_groups(state: TrainState, names_in_torch_order: list) -> list:
    t = state.ctx.config.train
    lr = state.ctx.schedule(max(state.step - 1, 0))  # the rate of the last step taken, as torch's group holds
    decays = {convert.torch_name(n): flag for n, flag in optimizer_lib.decays(state.params).items()}
    common = {"lr": lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "amsgrad": False, "maximize": False,
              "foreach": False, "capturable": False, "differentiable": False, "fused": False,
              "decoupled_weight_decay": True}
    return [{"weight_decay": t.weight_decay, **common, "params": [n for n in names_in_torch_order if decays[n]]},
            {"weight_decay": 0.0, **common, "params": [n for n in names_in_torch_order if not decays[n]]}]


def _torch_optimizer_state(state: TrainState) -> dict:
    import torch

    arch = state.ctx.model_def.arch
    count, mu, nu = optimizer_lib.adam_moments(state.opt_state)
    exp_avg = convert.to_torch(_to_host(mu), arch, with_tied_head=False)
    exp_avg_sq = convert.to_torch(_to_host(nu), arch, with_tied_head=False)
    names = [n for n in state.ctx.torch_names if n in exp_avg]  # torch's order; a tied head has no state
    step = torch.tensor(float(count))
    per_param = {n: {"step": step.clone(), "exp_avg": exp_avg[n], "exp_avg_sq": exp_avg_sq[n]} for n in names}
    return {"state": per_param, "param_groups": _param_groups(state, names)}


def _load_torch_optimizer_state(state: TrainState, path: pathlib.Path):
    import torch

    ctx = state.ctx
    saved = torch.load(path, weights_only=False)
    per_param = saved["state"]
    names = list(ctx.model_def.variables)
    if not per_param:  # saved before the first step: nothing to restore
        return state.opt_state
    arch = ctx.model_def.arch
    mu = convert.from_torch({k: v["exp_avg"] for k, v in per_param.items()}, names, arch, "train.resume")
    nu = convert.from_torch({k: v["exp_avg_sq"] for k, v in per_param.items()}, names, arch, "train.resume")
    count = int(next(iter(per_param.values()))["step"].item())
    moment_sharding = {n: ctx.param_sharding[n] for n in names}
    opt_state = optimizer_lib.replace_adam_moments(state.opt_state, jnp.asarray(count, jnp.int32),
                                                   place_all(mu, moment_sharding), place_all(nu, moment_sharding))
    return jax.device_put(opt_state, ctx.opt_sharding)
