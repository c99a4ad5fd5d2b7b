"""The torch lowering: FSDP2 (`fully_shard`) over NCCL (`--backend cuda`) or gloo (`--backend cpu`).

The functions below are its side of the backend contract: the `Backend` Protocol in portable_fsdp/backend.py.
The transformers model, the loss and the optimizer come from backends/hf_torch, shared with the xla lowering.
"""
# hf_torch first: importing it sets the environment transformers reads when it is first imported.
from portable_fsdp.backends.hf_torch.model import describe_model
from portable_fsdp.backends.torch.checkpoint import export_weights, load_checkpoint, save_checkpoint
from portable_fsdp.backends.torch.step import (any_rank, barrier, count_label_tokens, device_kind, eval_step, finalize,
                                              init, memory_report, model_info, placement, predict_step,
                                              time_all_reduce, time_matmul, train_step)

__all__ = ["init", "export_weights", "train_step", "eval_step", "count_label_tokens", "predict_step", "save_checkpoint",
           "load_checkpoint", "describe_model", "memory_report", "placement", "barrier", "any_rank", "device_kind",
           "time_matmul", "time_all_reduce", "model_info", "finalize"]
