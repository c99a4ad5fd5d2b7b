"""The torch lowering: FSDP2 (`fully_shard`) over NCCL (`--backend cuda`) or gloo (`--backend cpu`).

The functional surface the neutral loop drives: `init`, `train_step`, `eval_step`,
`save_checkpoint`, `load_checkpoint`, plus `describe_model` for start-up validation.
"""
import os

# torch_xla shares the venv; without this, transformers and accelerate probe it and log noise.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub at run time
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from portable_fsdp.backends.torch.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from portable_fsdp.backends.torch.model import describe_model  # noqa: E402
from portable_fsdp.backends.torch.step import (any_rank, barrier, count_label_tokens, eval_step, finalize, init,  # noqa: E402
                                              memory_report, model_info, peak_flops, placement, predict_step,
                                              train_step)

__all__ = ["init", "train_step", "eval_step", "count_label_tokens", "predict_step", "save_checkpoint",
           "load_checkpoint", "describe_model", "memory_report", "placement", "barrier", "any_rank", "peak_flops",
           "model_info", "finalize"]
