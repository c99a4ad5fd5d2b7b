"""plan.xla_fsdp_settings (Hugging Face's `xla_fsdp_settings`) and the plan's own fields -> keyword arguments of
torch_xla's XlaFullyShardedDataParallel (FSDP v1). SPMD FSDPv2 takes none of them: there they are ignored with one
warning (portable_fsdp/capabilities.py), as Hugging Face ignores them, once the two with a plan meaning moved onto
the plan (hf_import).

The accepted keys are read from the installed torch_xla's signature, less those this backend sets itself.
"""
from __future__ import annotations

import inspect

from portable_fsdp.errors import UserError
from portable_fsdp.plan import ShardingPlan

FIELD = "plan.xla_fsdp_settings"
# Keyword -> what sets it instead: the settings may not.
OWNED = {
    "module": "the backend",
    "auto_wrap_policy": "plan.auto_wrap_policy",
    "auto_wrapper_callable": "plan.activation_checkpointing / plan.xla_fsdp_grad_ckpt",
    "param_init_fn": "the backend (weights come from model.init_from or the seed)",
    "sharding_groups": "the plan's mesh (plan.fsdp_size)",
    "sharding_rank": "the plan's mesh (plan.fsdp_size)",
    "sharding_world_size": "the plan's mesh (plan.fsdp_size)",
}
DTYPE_KEYS = ("compute_dtype", "buffer_dtype")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def v1_signature() -> dict:
    """XlaFullyShardedDataParallel's keyword arguments and their defaults (imports torch_xla)."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    params = inspect.signature(XlaFullyShardedDataParallel.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self"}


def accepted_keys(signature: dict) -> list:
    """The public ones, for messages (torch_xla's `_debug...` keywords are accepted but not advertised)."""
    return sorted(name for name in signature if name not in OWNED and not name.startswith("_"))


def v1_kwargs(plan: ShardingPlan, settings: dict, signature: dict, weight_decay: float) -> dict:
    """Keyword arguments for every XlaFullyShardedDataParallel unit: the plan's fields, then the settings.
    A setting that contradicts a field the user changed from its default is an error naming both."""
    import torch

    mp = plan.mixed_precision
    kwargs = {"reshard_after_forward": plan.reshard_after_forward,
              "compute_dtype": getattr(torch, mp.param_dtype),
              # bf16/fp16 compute with float32 reductions: torch_xla's fp32_reduce_scatter.
              "fp32_reduce_scatter": mp.param_dtype != "float32" and mp.reduce_dtype == "float32"}
    for key, value in settings.items():
        _refuse_unknown_or_owned(key, signature)
        if key in DTYPE_KEYS:
            value = _dtype(key, value)
        elif isinstance(signature[key], bool) and not isinstance(value, bool):
            raise UserError(FIELD, f"key {key!r} must be true or false (got {value!r})")
        _check_agrees_with_plan(key, value, plan)
        kwargs[key] = value
    if kwargs.get("flatten_parameters") and weight_decay > 0:
        raise UserError(FIELD, (
            "key 'flatten_parameters' = true joins every parameter of a unit into one flat tensor, so AdamW can no "
            "longer exempt norms and biases from weight decay; remove it, or set train.weight_decay=0"))
    return kwargs


def _refuse_unknown_or_owned(key: str, signature: dict) -> None:
    if key in OWNED:
        raise UserError(FIELD, f"key {key!r} is set by {OWNED[key]}, not by the settings; remove it")
    if key not in signature:
        raise UserError(FIELD, (
            f"unknown key {key!r}; torch_xla's XlaFullyShardedDataParallel accepts: "
            f"{', '.join(accepted_keys(signature))}"))


def _dtype(key: str, value):
    import torch

    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise UserError(FIELD, f"key {key!r}: unknown dtype {value!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def _check_agrees_with_plan(key: str, value, plan: ShardingPlan) -> None:
    """The plan field wins silently over nothing: when both were set and differ, the user must choose."""
    mp = plan.mixed_precision
    if key == "reshard_after_forward" and not plan.reshard_after_forward and value:
        raise UserError(FIELD, "key 'reshard_after_forward' = true contradicts plan.reshard_after_forward=false; "
                        "set one of them")
    if key == "compute_dtype" and mp.param_dtype != "float32" and str(value) != f"torch.{mp.param_dtype}":
        raise UserError(FIELD, f"key 'compute_dtype' = {value} contradicts plan.param_dtype={mp.param_dtype}; "
                        "set one of them")
    if key == "fp32_reduce_scatter" and mp.param_dtype != "float32" and value != (mp.reduce_dtype == "float32"):
        raise UserError(FIELD, f"key 'fp32_reduce_scatter' = {str(value).lower()} contradicts "
                        f"plan.reduce_dtype={mp.reduce_dtype}; set one of them")


def refuse_parts_under_v1(plan: ShardingPlan, given: tuple) -> None:
    """FSDP v1 runs in processes torch_xla starts (xmp.spawn), which a model, loss, optimizer or schedule of the
    caller's process cannot reach."""
    if given and not plan.xla.xla_fsdp_v2:
        raise UserError("plan.xla_fsdp_v2", (f"is false, and FSDP v1's processes cannot receive the {', '.join(given)} "
                                             "passed in: set plan.xla_fsdp_v2=true (SPMD), which trains them in this "
                                             "process"))
