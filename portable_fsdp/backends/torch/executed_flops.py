"""FLOPs a training step really executes, per token: torch's FlopCounterMode over one forward and backward of the
model, in total and inside its experts modules — to set beside the FLOPs MFU assumes (6 × active parameters, plus
attention: portable_fsdp/training/metrics.py). Experts that computed padding, or tokens an expert was not chosen
for, would show as more executed than assumed.

torch 2.9's counter has no formula for the kernels a mixture of experts and a CPU step run: the grouped GEMM
(`_grouped_mm`, forward and backward) and the CPU's attention kernel; both are counted here as the matrix products
they are. Attention is counted over the full score matrix, causal or not, as MFU's 12·L·d·T does.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from portable_fsdp.backends.hf_torch.experts import expert_modules

aten = torch.ops.aten


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 × contraction length × output elements; with both operands 2-D the groups split the contraction
    (a weight gradient: out [G, M, N], the groups' contractions summing to a's columns)."""
    outputs = math.prod(out_shape[1:]) if len(a_shape) == len(b_shape) == 2 else math.prod(out_shape)
    return 2 * a_shape[-1] * outputs


def attention_flops(query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
    """Scores and weighted values: 2 products of b·h·s_q·s_k·d over the query heads (under grouped-query
    attention each key head serves several of them)."""
    batch, heads, queries, dim = query_shape
    return 4 * batch * heads * queries * key_shape[-2] * dim


def attention_backward_flops(grad_shape, query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
    """Backward of attention_flops: four products of the same size."""
    return 2 * attention_flops(query_shape, key_shape)


FORMULAS = {aten._grouped_mm: grouped_mm_flops,
            aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops}


def per_token(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """{"model": FLOPs per token of one forward and backward of `model` on the batch, "experts": of them in its
    experts modules, both directions}. The model's gradients are cleared afterwards.

    The experts' share is counted by running each experts module again, alone, on the inputs it received in the
    step: the counter's per-module split is exact in forward only (in backward it charges the router's gradient to
    the experts, which the router's weights enter)."""
    received = []
    hooks = [m.register_forward_hook(lambda module, args, out: received.append((module, args)))
             for m in expert_modules(model)]
    try:
        with FlopCounterMode(display=False, custom_mapping=FORMULAS) as whole:
            model(input_ids=input_ids, labels=labels).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    with FlopCounterMode(display=False, custom_mapping=FORMULAS) as experts:
        for module, args in received:
            out = module(*(a.detach().requires_grad_(a.is_floating_point()) for a in args))
            out.backward(torch.ones_like(out))
    model.zero_grad(set_to_none=True)
    tokens = input_ids.numel()
    return {"model": whole.get_total_flops() / tokens, "experts": experts.get_total_flops() / tokens}
