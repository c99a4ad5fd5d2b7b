"""A transformers mixture-of-experts model's routed experts, as both torch-based lowerings see them: which modules
hold them, how many weights they are and how many a token runs through (MFU counts only those), and which of
transformers' expert implementations runs them on a device.

transformers keeps a MoE layer's experts fused in one module (Mixtral, Qwen3-MoE, ...: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]) whose forward dispatches on `config._experts_implementation`: `grouped_mm`
(its default whenever torch has the kernel), `batched_mm` or `eager` (a loop over the experts that were hit).
Left to that default, the choice depends on the device, the torch version and even the weights' addresses; the
lowering names it per device instead (`choose`), and the GPU tests run what it names.
"""
from __future__ import annotations

from torch import nn

# Where MoE configs keep how many routed experts each token is sent to.
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_top_k", "top_k")


def expert_modules(model: nn.Module) -> list:
    """The fused experts modules of `model`: transformers' classes decorated with `use_experts_implementation`
    (which marks them with `_is_expert_parallel`)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def routed_expert_params(model: nn.Module) -> int:
    """Parameters of every routed expert of `model` (0 for a dense model): the fused experts modules, or an
    `experts` ModuleList of separate expert MLPs. Shared experts and routers live elsewhere: every token uses them."""
    modules = expert_modules(model) or [m for name, m in model.named_modules()
                                        if name.rsplit(".", 1)[-1] == "experts" and isinstance(m, nn.ModuleList)]
    return sum(p.numel() for m in modules for p in m.parameters())


def experts_per_token(cfg) -> int:
    """How many routed experts each token runs through (the router's top-k; 0 when the config does not say)."""
    return int(next((getattr(cfg, key) for key in TOP_K_KEYS if getattr(cfg, key, None)), 0))


def choose(device_type: str) -> str:
    """The experts implementation for experts computed on `device_type`: torch's grouped GEMM (`grouped_mm`: all
    of a layer's experts in one kernel, no loop, no data-dependent graph — which `plan.compile` needs) on CUDA,
    where torch 2.9 runs bfloat16 on Hopper's grouped kernel and other dtypes on its own fallback, and on the CPU,
    whose kernel takes every float dtype; elsewhere the `eager` loop over the experts that were hit (XLA registers
    its own: portable_fsdp/backends/xla/moe.py)."""
    return "grouped_mm" if device_type in ("cuda", "cpu") else "eager"


def set_implementation(model: nn.Module, implementation: str) -> None:
    """Run `model`'s experts with `implementation` (a model without fused experts is left as it is)."""
    if expert_modules(model) and model.config._experts_implementation != implementation:
        model.set_experts_implementation(implementation)
