"""The contract's `describe_model` on --backend flax: the user's flax.nnx module, described from the module itself
(user_model.py), or the config's transformers model (architecture.py)."""
from __future__ import annotations

from portable_fsdp.backend import ModelInfo
from portable_fsdp.backends.flax import architecture, user_model
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts


def describe_model(config, parts: Parts = NO_PARTS) -> ModelInfo:
    if parts.model is not None:
        return user_model.describe(parts.model, tuple(config.plan.transformer_layer_cls_to_wrap))
    return architecture.describe_model(config)
