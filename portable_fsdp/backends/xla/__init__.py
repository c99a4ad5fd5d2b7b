"""The torch_xla lowering (`--backend xla`): SPMD FSDPv2 by default, FSDP v1 with plan.xla_fsdp_v2=false.

The same functional surface as the torch backend. torch_xla reads its environment (which device, how many
CPU devices) once, so importing this package imports no torch_xla: the launcher sets the environment first
(see `launch`), and the surface below is loaded on first use.
"""
import importlib

from portable_fsdp.backends.hf_torch.model import describe_model  # the same transformers model: shared

_SURFACE = {
    **dict.fromkeys(("init", "train_step", "eval_step", "count_label_tokens", "predict_step", "placement",
                     "barrier", "any_rank", "model_info", "finalize"), "step"),
    **dict.fromkeys(("memory_report", "device_kind", "time_matmul", "time_all_reduce",
                     "start_trace", "step_annotation", "stop_trace", "watch_memory"), "resources"),
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "export_weights": "checkpoint",
    "estimate_memory": "estimate",
    **dict.fromkeys(("device_type", "default_nproc", "prepare_config", "start_workers", "check_machines", "owns_workdir",
                     "sharded_format", "convert_sharded", "estimate_devices", "estimator_environment"), "launch"),
}

__all__ = [*_SURFACE, "describe_model"]


def __getattr__(name: str):
    if name in _SURFACE:
        module = importlib.import_module(f"{__name__}.{_SURFACE[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
