"""The torch lowering: FSDP2 (`fully_shard`) over NCCL (`--backend cuda`) or gloo (`--backend cpu`).

The functions below are its side of the backend contract: the `Backend` Protocol in portable_fsdp/backend.py.
The transformers model, the loss and the optimizer come from portable_fsdp/backends/hf_torch, shared with the xla lowering.
Each is loaded on first use, so the command's questions before any worker starts (`launch`) import no torch.
"""
import importlib

_DEFINED_IN = {
    "describe_model": "model",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "export_weights": "checkpoint",
    "convert_sharded": "sharded_to_full",
    "estimate_memory": "estimate",
    **dict.fromkeys(("init", "train_step", "eval_step", "count_label_tokens", "predict_step", "placement",
                     "barrier", "any_rank", "model_info", "finalize"), "step"),
    **dict.fromkeys(("memory_report", "device_kind", "time_matmul", "time_all_reduce",
                     "start_trace", "step_annotation", "stop_trace", "watch_memory"), "resources"),
    **dict.fromkeys(("device_type", "default_nproc", "prepare_config", "start_workers", "check_machines", "owns_workdir",
                     "sharded_format", "estimate_devices", "estimator_environment"), "launch"),
}
__all__ = list(_DEFINED_IN)


def __getattr__(name: str):
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # hf_torch first: importing it sets the environment transformers reads when it is first imported.
    importlib.import_module("portable_fsdp.backends.hf_torch")
    module = "portable_fsdp.backends.hf_torch.model" if name == "describe_model" else f"{__name__}.{_DEFINED_IN[name]}"
    return getattr(importlib.import_module(module), name)
