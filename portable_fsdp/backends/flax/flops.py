"""The expert FLOPs a token costs on the flax backend as its MoE kernel runs them (moe.py's shapes: rows padded
to blocks on CPU, room for every slot an ep peer could send), beside the 6 × active parameters that MFU credits
(portable_fsdp.training.metrics counts a token's top-k experts only)."""
from __future__ import annotations

import dataclasses

from portable_fsdp import routed_blocks
from portable_fsdp.placement import EP, TP
from portable_fsdp.backends.flax import moe
from portable_fsdp.backends.flax.architecture import LlamaArchitecture


@dataclasses.dataclass(frozen=True)
class ExpertFlops:
    """Training FLOPs (forward and backward) per token in the experts of every MoE layer."""

    executed: float  # what the kernel's shapes compute, padding and unused room included
    active: float  # 6 × the expert parameters of the token's top-k experts

    @property
    def ratio(self) -> float:
        return self.executed / self.active


def expert_flops_per_token(arch: LlamaArchitecture, tokens: int, platform: str, groups: dict | None = None
                           ) -> ExpertFlops:
    """`tokens`: one device's tokens per micro-batch, on a jax `platform`; `groups`: what the experts are split
    over (moe.expert_groups: ep, devices holding different tokens; tp, devices holding the same ones)."""
    ep, tp = (groups or {}).get(EP, 1), (groups or {}).get(TP, 1)
    experts, top_k = arch.num_experts, arch.experts_per_token
    per_row = 6 * 3 * arch.hidden_size * arch.intermediate_size  # 3 matmuls, 2 FLOPs a product, backward 2× forward
    local = experts // (ep * tp)
    rows = ep * routed_blocks.capacity(tokens, top_k, local)
    if moe.kernel_for(platform) is moe.block_mlp:
        rows = routed_blocks.padded_rows(rows, local)
    # an ep × tp group computes ep × tp devices' rows for the ep × `tokens` tokens its ep ranks hold
    executed = tp * rows * per_row / tokens
    return ExpertFlops(executed * arch.num_layers, top_k * per_row * arch.num_layers)
