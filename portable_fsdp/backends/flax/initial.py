"""The initial weights on the devices, one parameter at a time.

They are the torch backends' initial model — the seeded random init, or model.init_from's weights — converted, so
every backend starts from one set of weights. The transformers model is built on the meta device
(hf_torch.model.create_on_meta: the seeded init recorded there and replayed, or the safetensors files read, one
parameter at a time); each torch parameter, as it is delivered, is converted to its flax name and layout, placed
on the devices with its sharding at once (sharding.place: with several processes, each copies only its own
devices' shards) and dropped from the host. The process then holds the placed model plus one parameter in
transit, where building the torch model whole, converting it and placing it held about three copies
(tests/flax/test_meta_init.py measures both).

When create_on_meta cannot give create_model's values bit for bit (an init the replay cannot reproduce, a
checkpoint whose names transformers converts on loading, a hub id), the model is built whole as before.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib, sharding
from portable_fsdp.errors import UserError


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    model_def: model_lib.ModelDef
    hf_config: object  # the transformers config, written into FULL checkpoints
    torch_names: tuple  # the torch state-dict order, for checkpoints in torch's layout
    place: Callable[[dict], dict]  # {flax name: NamedSharding} -> {flax name: jax.Array}


def prepare(config, remat: bool) -> InitialWeights:
    """The model's definition, and how to place its initial weights once their shardings are known."""
    from portable_fsdp.backends.hf_torch.model import create_on_meta

    on_meta = create_on_meta(config)
    if on_meta is None:
        return built_whole(config, remat)
    model_def = _define(on_meta.model.config, remat)
    return InitialWeights(model_def, on_meta.model.config, tuple(on_meta.model.state_dict()),
                          lambda shardings: stream(on_meta.fill, model_def, shardings))


def built_whole(config, remat: bool) -> InitialWeights:
    """The whole torch model built on the CPU, converted and placed: about three copies of it at once."""
    from portable_fsdp.backends.hf_torch.model import create_model

    hf_model = create_model(config, rank=0, rank0_only=False)
    model_def = _define(hf_model.config, remat)
    torch_state = hf_model.state_dict()
    host = torch_weights.from_torch(torch_state, model_def.variables, model_def.arch)
    return InitialWeights(model_def, hf_model.config, tuple(torch_state),
                          lambda shardings: sharding.place_all(host, shardings))


def _define(hf_config, remat: bool) -> model_lib.ModelDef:
    return model_lib.define(architecture.from_hf_config(hf_config), remat=remat)


def stream(fill, model_def: model_lib.ModelDef, shardings: dict, field: str = "model.init_from") -> dict:
    """{flax name: jax.Array}: `fill(deliver)` (hf_torch.deferred_init.OnMeta) hands over each torch parameter in turn (tied
    names together, one flax array); each is converted and placed before the next is made."""
    flax_name, shapes = torch_weights.by_torch_name(model_def.variables), model_def.shapes
    params: dict = {}

    def deliver(names, full):
        targets = {flax_name[n] for n in names if n in flax_name}
        if len(targets) != 1 or targets & params.keys():
            raise UserError(field, f"{', '.join(names)} is {'delivered twice' if targets else 'not a parameter'} "
                                   "of the flax model")
        (name,) = targets
        host = torch_weights.to_flax(name, full)
        expected = shapes[name].shape
        if host.shape != expected:
            raise UserError(field, f"{names[0]} has shape {tuple(full.shape)}; the model's is {expected} in flax")
        params[name] = sharding.place(host, shardings[name])

    fill(deliver)
    torch_weights.require_all(model_def.variables, {torch_weights.torch_name(n) for n in params}, field)
    return params
