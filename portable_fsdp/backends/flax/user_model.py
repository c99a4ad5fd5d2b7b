"""A flax.nnx module of the user's own (`portable_fsdp.init(..., model=module)`) as the flax lowering trains it.

The module is split into its graph and a flat {dotted path: array} of its nnx.Param values — the form the built-in
model's parameters take (model.ModelDef) — so the plan places them, the programs differentiate them and the
checkpoints save them (by those dotted paths, as they are) exactly as the built-in model's. Variables that are not
nnx.Param (RNG streams, statistics) stay as the module held them: a step neither trains nor advances them. The
module's `_tp_plan` (transformers' notation, keys relative to the module: `layers.*.up: colwise`) splits it over tp.

It is called as `module(input_ids, position_ids=...)` when its __call__ takes position_ids, else
`module(input_ids)`, and returns logits [batch, seq, vocab] or an object with `.logits`.
"""
from __future__ import annotations

import dataclasses
import inspect
import pathlib
import sys

import numpy as np
from flax import nnx

from portable_fsdp.backend import ModelInfo
from portable_fsdp.backends.flax import initial, sharding
from portable_fsdp.backends.flax.model import dotted, undotted
from portable_fsdp.checkpoint import safetensors_shards
from portable_fsdp.errors import UserError


@dataclasses.dataclass(frozen=True)
class UserModelDef:
    """The module's graph without its parameter values, and how to bind a flat parameter dict to it."""

    graphdef: object
    variables: dict  # dotted name -> nnx.Param holding a ShapeDtypeStruct (no value)
    others: object  # the module's variables that are not nnx.Param, kept as they are
    takes_positions: bool
    router_aux_loss_coef: float = 0.0  # no load-balancing loss of ours

    @property
    def shapes(self) -> dict:
        return {name: var.get_value() for name, var in self.variables.items()}

    def bind(self, params: dict):
        state = nnx.from_flat_state({undotted(name): var.replace(params[name]) for name, var in self.variables.items()})
        return nnx.merge(self.graphdef, state, self.others)

    def forward(self, params: dict, input_ids, positions, layout=None):
        """(what the module returned, 0: no load-balancing loss). `layout` is the built-in model's: a module of
        the user's own places its activations as XLA chooses."""
        module = self.bind(params)
        outputs = module(input_ids, position_ids=positions) if self.takes_positions else module(input_ids)
        return outputs, 0.0

    def plan_name(self, name: str) -> str:
        """The name a tensor-parallel plan's patterns are matched against: the module's `_tp_plan` keys are
        relative to the module itself, the whole of which is the "base model" (sharding.BASE_MODEL)."""
        return sharding.BASE_MODEL + name

    # FULL checkpoints keep the parameters by their dotted paths, in the module's own layout.
    def saved_name(self, name: str) -> str:
        return name

    def saved_layout(self, name: str, array):
        return array

    def read_saved(self, directory) -> dict:
        """{dotted name: numpy array} of a FULL checkpoint's weights."""
        from safetensors.numpy import load_file

        files = safetensors_shards.weight_files(pathlib.Path(directory), "train.resume")
        stored = {name: array for file in files for name, array in load_file(file).items()}
        unmatched = [name for name, shape in self.shapes.items()
                     if name not in stored or stored[name].shape != shape.shape]
        if unmatched or not files:
            raise UserError("train.resume", (
                f"{directory} holds no weights of this model's shape for "
                f"{', '.join(unmatched[:5]) or 'any parameter'}; resume with the model it was saved with"))
        return {name: stored[name] for name in self.variables}


def logits_of(outputs):
    """The logits of what a model returned: the array itself, or its `.logits`."""
    return getattr(outputs, "logits", outputs)


def check_module(model, field: str = "model") -> None:
    """A flax.nnx.Module, or one line saying what to pass instead."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        raise UserError(field, (f"{type(model).__name__} is a torch.nn.Module, which --backend flax cannot train; "
                                "pass its flax.nnx counterpart, or train it with --backend cpu, cuda or xla"))
    if not isinstance(model, nnx.Module):
        raise UserError(field, f"{type(model).__name__} is not a flax.nnx.Module; --backend flax trains one")


def _takes_positions(model) -> bool:
    return "position_ids" in inspect.signature(type(model).__call__).parameters


def prepare(model) -> initial.InitialWeights:
    """The module's definition, and how to place its current parameter values once their shardings are known."""
    check_module(model)
    graphdef, params, others = nnx.split(model, nnx.Param, ...)
    flat = {dotted(path): var for path, var in nnx.to_flat_state(params)}
    variables = {name: var.replace(_abstract(var.get_value())) for name, var in flat.items()}
    model_def = UserModelDef(graphdef, variables, others, _takes_positions(model))

    def place(shardings: dict) -> dict:
        return {name: sharding.place(np.asarray(var.get_value()), shardings[name]) for name, var in flat.items()}

    return initial.InitialWeights(model_def, None, (), place)


def _abstract(value):
    import jax

    return jax.ShapeDtypeStruct(value.shape, value.dtype)


def describe(model, wrap_classes: tuple = ()) -> ModelInfo:
    """ModelInfo of the module: its classes, parameters, layers (the submodules of a class the plan wraps, else
    of its `_no_split_modules`) and, for the data and MFU, its hidden and vocabulary sizes — an nnx.Embed's, else
    its `hidden_size` / `vocab_size` attributes."""
    check_module(model)
    modules = [module for _, module in nnx.iter_modules(model)]
    inner: dict = {}
    for _, module in nnx.iter_modules(model):
        inner.setdefault(type(module).__name__, set()).update(
            type(child).__name__ for _, child in nnx.iter_modules(module) if child is not module)
    no_split = tuple(getattr(model, "_no_split_modules", None) or ())
    layer_classes = tuple(wrap_classes) or no_split
    embeds = [m for m in modules if isinstance(m, nnx.Embed)]
    vocab = embeds[0].num_embeddings if embeds else getattr(model, "vocab_size", 0)
    hidden = embeds[0].features if embeds else getattr(model, "hidden_size", 0)
    if not vocab:
        raise UserError("model", (f"{type(model).__name__} has no nnx.Embed and no vocab_size attribute, so its "
                                  "vocabulary size is unknown; give it a vocab_size attribute"))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    sizes = {dotted(path): int(np.prod(var.get_value().shape)) for path, var in nnx.to_flat_state(params)}
    embedding_params = sum(int(np.prod(m.embedding.get_value().shape)) for m in embeds)
    return ModelInfo(
        class_names=tuple(sorted(inner)), no_split_modules=no_split, n_params=sum(sizes.values()),
        n_layers=sum(type(m).__name__ in layer_classes for m in modules), hidden_size=int(hidden),
        vocab_size=int(vocab), n_embedding_params=embedding_params, root_class=type(model).__name__,
        inner_classes={name: tuple(sorted(classes)) for name, classes in inner.items()},
        tp_plan=dict(getattr(model, "_tp_plan", None) or {}))
