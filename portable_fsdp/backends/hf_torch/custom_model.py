"""A model the user brings (`portable_fsdp.init(..., model=module)`: any torch.nn.Module) on both torch-based
lowerings: what start-up checks and MFU read of it (`describe`), how each rank fills a module built on the meta
device (`on_meta`: its own init replayed with train.seed, one parameter at a time) and how it is called
(`Forward`). Its wrap classes are its `_no_split_modules`, its tensor-parallel plan its `_tp_plan`, as for a
transformers model."""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from portable_fsdp.backend import ModelInfo
from portable_fsdp.backends.hf_torch import deferred_init
from portable_fsdp.errors import UserError


def require_module(model) -> nn.Module:
    """`model` itself when it is a torch.nn.Module; else one line saying what these backends take."""
    if not isinstance(model, nn.Module):
        raise UserError("model", (
            f"is a {type(model).__module__}.{type(model).__name__}; the cpu, cuda and xla backends train a "
            "torch.nn.Module (a flax.nnx.Module trains with backend flax)"))
    return model


def describe(module: nn.Module) -> ModelInfo:
    """The ModelInfo of a user's module (on the meta device or built): its classes, sizes and plans. n_layers
    counts the instances of its `_no_split_modules` classes; vocab_size and hidden_size are its attributes of
    those names, else its first nn.Embedding's."""
    require_module(module)
    no_split = tuple(getattr(module, "_no_split_modules", None) or ())
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    vocab_size = getattr(module, "vocab_size", None) or (embeddings[0].num_embeddings if embeddings else 0)
    if not vocab_size:
        raise UserError("model", (f"{type(module).__name__} has no nn.Embedding and no vocab_size attribute: set "
                                  "model.vocab_size, which the data check reads"))
    hidden_size = getattr(module, "hidden_size", None) or (embeddings[0].embedding_dim if embeddings else 0)
    owners: dict = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    # an embedding table is a lookup, left out of MFU's 6·N, unless another module (a tied head) multiplies by it
    lookups = sum(p.numel() for m in embeddings for p in m.parameters(recurse=False)
                  if all(isinstance(o, nn.Embedding) for o in owners[id(p)]))
    inner: dict = {}
    for m in module.modules():
        inner.setdefault(type(m).__name__, set()).update(type(c).__name__ for c in m.modules() if c is not m)
    return ModelInfo(
        class_names=tuple(sorted(inner)), no_split_modules=no_split,
        n_params=sum({id(p): p.numel() for p in module.parameters()}.values()),
        n_layers=sum(type(m).__name__ in no_split for m in module.modules()),
        hidden_size=int(hidden_size), vocab_size=int(vocab_size), n_embedding_params=lookups,
        root_class=type(module).__name__, inner_classes={k: tuple(sorted(v)) for k, v in inner.items()},
        tp_plan=dict(getattr(module, "_tp_plan", None) or {}))


def on_meta(module: nn.Module, seed: int):
    """A deferred_init.OnMeta for a module whose parameters are on the meta device: its `init_weights()` (else
    every submodule's `reset_parameters()`) replayed from `seed`, one parameter at a time — every rank draws the
    values of `torch.manual_seed(seed); module.to_empty(device="cpu"); init()`. None for a built module (its
    weights are the ones trained)."""
    if not any(p.is_meta for p in module.parameters()):
        return None
    meta_buffers = [name for name, b in module.named_buffers() if b.is_meta]
    if meta_buffers:
        raise UserError("model", (f"{type(module).__name__}'s buffer {meta_buffers[0]} is on the meta device, "
                                  "where no value can be computed: register buffers outside `torch.device('meta')`"))
    try:
        recording = deferred_init.record_init(module, _init_function(module))
    except deferred_init.Unsupported as why:
        raise UserError("model", (f"{type(module).__name__} on the meta device cannot be initialised shard by shard "
                                  f"({why}): give it an init_weights() that writes every parameter, or build it "
                                  "on the CPU")) from None
    return deferred_init.OnMeta(module, lambda deliver: deferred_init.replay(recording, seed, deliver), dict(module.named_buffers()))


def _init_function(module: nn.Module):
    own = getattr(module, "init_weights", None)
    if callable(own):
        return own
    resets = [m.reset_parameters for m in module.modules() if callable(getattr(m, "reset_parameters", None))]
    return lambda: [reset() for reset in resets]


@dataclasses.dataclass(frozen=True)
class Forward:
    """How a step calls a user's module: `model(input_ids, position_ids=...)` when its forward takes
    position_ids, else `model(input_ids)`. Read before any wrapper hides the module's own signature."""

    takes_positions: bool

    @classmethod
    def of(cls, module: nn.Module) -> "Forward":
        return cls("position_ids" in inspect.signature(module.forward).parameters)

    def __call__(self, model, input_ids, position_ids):
        return model(input_ids, position_ids=position_ids) if self.takes_positions else model(input_ids)


def transformers_forward(model, input_ids, position_ids):
    """How a step calls a transformers model."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False)


def logits_of(outputs) -> torch.Tensor:
    """The logits a model returned: the tensor itself, or its `.logits`."""
    return outputs if isinstance(outputs, torch.Tensor) else outputs.logits


def check_run(model, config, plan) -> None:
    """Before anything starts: a user's `model` is a torch.nn.Module, and the run asks nothing of it that only a
    transformers model has — context and sequence parallelism replace transformers' attention, which a user's
    module does not call; train.gradient_checkpointing is transformers' own switch."""
    require_module(model)
    for field, size in (("plan.cp_size", plan.mesh.cp_size), ("plan.sp_size", plan.mesh.sp_size)):
        if size > 1:
            raise UserError(field, (f"is {size}, but a model passed in runs its own attention, which the sequence "
                                    "split cannot reach: set it to 1 (fsdp and tp apply)"))
    if config.train.gradient_checkpointing:
        raise UserError("train.gradient_checkpointing", ("is transformers' own checkpointing; for a model passed in "
                                                         "set plan.activation_checkpointing=true instead"))
    if config.model.peft.type:
        raise UserError("model.peft", ("adds adapters to the config's model; to a model passed in add them yourself "
                                       "(peft.inject_adapter_in_model) and leave model.peft unset"))
