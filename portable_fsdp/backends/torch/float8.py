"""float8 matmuls (plan.float8) through torchao's float8 training, on CUDA GPUs with float8 tensor cores.

`convert_to_float8_training` swaps chosen `nn.Linear` modules for torchao's `Float8Linear` before any other
technique touches the model (torchtitan converts its model before parallelizing it): each forward casts the
input and the weight to float8 (e4m3) with one dynamic scale per tensor, the backward casts the output gradient
to e5m2, and `torch._scaled_mm` multiplies them on the tensor cores. Parameters, their names, the optimizer and
the checkpoints stay what they were: only the products change. FSDP2 gathers the weights as usual (in
plan.param_dtype) and they are cast after the gather.

Which layers convert: every `nn.Linear` except the model's output projection (lm_head: the logits' precision
matters most, and its vocabulary-sized output is where float8 loses most), and only those whose input and
output features are both divisible by 16, as `torch._scaled_mm` requires. A MoE model's fused experts are not
Linear modules and its routers are not either (transformers' own modules): they stay in plan.param_dtype.

torchao is imported only when plan.float8 is set: it is an optional dependency, in the release built for the
installed torch (portable_fsdp/machine/gpu_packages.py; `pip install 'portable_fsdp[gpu]'` pins 0.14.1, torch 2.9's).
The casts are separate kernels unless the layer is compiled: use it with plan.compile.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from portable_fsdp.machine import gpu_packages
from portable_fsdp.errors import UserError

INSTALL = f"pip install 'torchao=={gpu_packages.torchao_for(torch.__version__)}'"
FLOAT8_CAPABILITY = (8, 9)  # Ada (L4) and Hopper (H100, H200) onwards have float8 tensor cores
DIVISOR = 16  # torch._scaled_mm: both dimensions of each operand (the tokens too, in the weight's gradient)


def check_supported(device: torch.device, tokens_per_rank: int) -> None:
    """Refuse plan.float8 at start-up, with one line, where it cannot run: torchao missing or not importable
    here, a GPU without float8 tensor cores, or micro-batches whose tokens per rank `torch._scaled_mm` cannot
    take (the weight gradient's product runs over them). (cpu, xla and flax are refused by the capability table.)"""
    _torchao_float8()
    if tokens_per_rank % DIVISOR:
        raise UserError("plan.float8", (
            f"each rank's micro-batch holds {tokens_per_rank} tokens, and float8 products need a multiple of "
            f"{DIVISOR} (the weights' gradients are summed over them); choose train.batch_size, "
            "train.grad_accum_steps and data.seq_len so that rows x tokens per rank divide by 16"))
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FLOAT8_CAPABILITY:
            raise UserError("plan.float8", (
                f"needs float8 tensor cores (compute capability {FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} or "
                f"newer: L4, H100, H200, B200); {torch.cuda.get_device_name(device)} has "
                f"{capability[0]}.{capability[1]}: set plan.float8=false"))


def _torchao_float8():
    """torchao.float8, or a UserError naming the install command."""
    try:
        return importlib.import_module("torchao.float8")
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "torchao":
            raise UserError("plan.float8", f"needs torchao, which is not installed: {INSTALL}") from None
        raise
    except ImportError as err:  # a torchao built for another torch
        raise UserError("plan.float8", (
            f"torchao does not import with torch {torch.__version__} ({str(err).splitlines()[0]}); install the "
            f"release built for it: {INSTALL}")) from None


def converts(model: nn.Module):
    """The module filter: whether `module` (a Linear of `model`) becomes a Float8Linear."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module is not output
                and module.in_features % DIVISOR == 0 and module.out_features % DIVISOR == 0)

    return keep


def apply_float8(model: nn.Module) -> list:
    """Swap the chosen Linear layers of `model` for Float8Linear, in place; returns their names."""
    float8 = _torchao_float8()
    keep = converts(model)
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    float8.convert_to_float8_training(model, module_filter_fn=keep, config=float8.Float8LinearConfig())
    return chosen
