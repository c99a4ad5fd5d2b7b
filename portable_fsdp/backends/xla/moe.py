"""Mixture-of-experts models (Mixtral, Qwen3-MoE, ...) on torch_xla: transformers' defaults count tokens per
expert with `torch.histc` on integer expert ids, which is implemented for CUDA only ("histogram_cpu" not
implemented for 'Int' on PJRT CPU, the device type being "xla", not "cpu"). Two targeted changes, no fork of
the model code:

- the experts run in fixed-size blocks of routed pairs (portable_fsdp/backends/xla/expert_blocks.py, registered
  through transformers' ExpertsInterface): only the routed work, in static shapes that XLA compiles once —
  instead of `grouped_mm` (histc offsets, a grouped GEMM XLA lacks), the eager loop over the experts that were
  hit (a graph per routing pattern) or `batched_mm` (a copy of each pair's expert weights); under expert
  parallelism parallelize.py swaps in the dispatching variant (expert_dispatch.py);
- `torch.histc` takes integer input as float (exact for counts below 2**24): the router's load-balancing
  loss (computed when the model's config sets output_router_logits) counts with it.
"""
from __future__ import annotations

import functools

import torch

from portable_fsdp.backends.hf_torch import experts
from portable_fsdp.backends.xla import expert_blocks

XLA_EXPERTS = "portable_fsdp_expert_blocks"


def prepare(model: torch.nn.Module) -> None:
    """Make a transformers MoE model trainable under torch_xla (a model without experts is left as it is)."""
    if not experts.experts_per_token(model.config):  # the routing setting of every transformers MoE config
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(XLA_EXPERTS, expert_blocks.experts_forward)
    experts.set_implementation(model, XLA_EXPERTS)
    _histc_takes_integers()


def _histc_takes_integers() -> None:
    if getattr(torch.histc, "_portable_fsdp", False):
        return
    original = torch.histc

    @functools.wraps(original)
    def histc(input, *args, **kwargs):
        return original(input if input.is_floating_point() else input.float(), *args, **kwargs)

    histc._portable_fsdp = True
    torch.histc = histc
