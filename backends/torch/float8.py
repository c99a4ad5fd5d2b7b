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

torchao is imported only when plan.float8 is set: it is an optional dependency (`pip install
'portable_fsdp[gpu]'`), pinned to 0.14.1, the release built for torch 2.9 (newer ones fail to import there).
The casts are separate kernels unless the layer is compiled: use it with plan.compile.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from portable_fsdp.errors import UserError

TORCHAO = "0.14.1"
INSTALL = f"pip install 'torchao=={TORCHAO}' (or pip install 'portable_fsdp[gpu]')"
FLOAT8_CAPABILITY = (8, 9)  # Ada (L4) and Hopper (H100, H200) onwards have float8 tensor cores


def check_supported(device: torch.device) -> None:
    """Refuse plan.float8 at start-up, with one line, where it cannot run: torchao missing or not importable
    here, or a GPU without float8 tensor cores. (cpu, xla and flax are refused by the capability table.)"""
    _torchao_float8()
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
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    return keep


def apply_float8(model: nn.Module) -> list:
    """Swap the chosen Linear layers of `model` for Float8Linear, in place; returns their names."""
    float8 = _torchao_float8()
    keep = converts(model)
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    float8.convert_to_float8_training(model, module_filter_fn=keep, config=float8.Float8LinearConfig())
    return chosen
