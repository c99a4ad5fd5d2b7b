"""The Flax/JAX lowering (`--backend flax`): the same Llama in flax.nnx, the plan as JAX shardings.

The functional surface the neutral loop drives (see portable_fsdp/training/loop.py). Nothing here imports
jax until one of these functions is first used: the launcher loads this package, then sets up the
host devices (XLA_FLAGS, JAX_PLATFORMS), and only then does jax start.

Modules: architecture (the Llama's shape from a transformers config), rope, model (flax.nnx), moe (a MoE layer's
routed experts), flops (the expert FLOPs they execute per token), user_model (a flax.nnx model of the user's own,
in the built-in model's place), description (the model described, either), torch_weights (torch <-> flax
weights), sharding (mesh and PartitionSpecs), optimizer (optax = torch's AdamW), programs (the jitted update,
eval and predict), step (init / train_step / ...), checkpoint, devices, resources (memory and matmul rate for the
metrics), processes (one JAX process per machine: what changes), launch (what the command asks before jax starts,
and the start itself), estimate (the memory estimate).
"""
import importlib
import os

# The weights come from transformers (torch): keep it from probing torch_xla.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

_DEFINED_IN = {
    "describe_model": "description",
    "save_checkpoint": "checkpoint", "export_weights": "checkpoint",
    "load_checkpoint": "checkpoint",
    "memory_report": "resources",
    "device_kind": "resources",
    "time_matmul": "resources",
    "time_all_reduce": "resources",
    **dict.fromkeys(("start_trace", "step_annotation", "stop_trace", "watch_memory"), "resources"),
    "estimate_memory": "estimate",
    **dict.fromkeys(("device_type", "default_nproc", "prepare_config", "start_workers", "check_machines", "owns_workdir",
                     "sharded_format", "convert_sharded", "estimate_devices", "estimator_environment"), "launch"),
    **dict.fromkeys(("init", "train_step", "eval_step", "count_label_tokens", "predict_step", "placement",
                     "barrier", "any_rank", "model_info", "finalize"), "step"),
}
__all__ = list(_DEFINED_IN)


def __getattr__(name: str):
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_DEFINED_IN[name]}"), name)
