"""Causal attention on CPU that skips the masked half: the model's `sdpa` attention, query block by query block.

torch's CPU flash-attention kernel (what `scaled_dot_product_attention` runs on CPU) skips masked work only at the
granularity of its key blocks, which span up to 512 positions: at the lengths CPU training runs, `is_causal`
costs what full attention costs (measured with torch 2.9: 4 x 8 heads x 512 positions, forward + backward,
causal within 2% of non-causal). Here the queries go in blocks (`query_block`) and each block attends only the keys
up to its last position — block i of n reads (i + 1) / n of the keys, (n + 1) / 2n of the work in all
— the diagonal block under a mask, the first one with the kernel's own `is_causal`. The keys a block leaves out are
exactly those the causal mask would zero, so the result is the same attention (to float rounding: the softmax sums
fewer exact zeros).

Only what that covers takes the blocked path: a causal self-attention (no attention mask: transformers' sdpa mask
function returns none for plain causal batches), no dropout, longer than one block. Anything else — padding or
packed-document masks, sliding windows that bite, a cache, dropout — is transformers' own sdpa call, unchanged.
CUDA's kernels skip masked blocks themselves, so only the cpu device gets this (`parallelize`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Query block by sequence length, measured with torch 2.9 on one core (forward + backward, blocks against each
# other alternating): 64 beats 128 by 8% at 256 positions and 2% at 512; at 1024, 128 beats 64 by 10% and the
# plain kernel by 10%; from 2048 the kernel's own per-key-block skipping is as good (blocks of 128 were 3% slower).
SHORT_BLOCK, LONG_BLOCK, SHORT_UP_TO, KERNEL_SKIPS_FROM = 64, 128, 512, 2048


def query_block(length: int) -> int | None:
    """The query block for a causal sequence of `length` positions; None where blocks would not pay."""
    if length >= KERNEL_SKIPS_FROM:
        return None
    block = SHORT_BLOCK if length <= SHORT_UP_TO else LONG_BLOCK
    return block if length > block else None
NAME = "portable_fsdp_blocked_causal_sdpa"


def blocked_causal_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention signature: q [batch, heads, positions, dim], k/v [batch, kv heads, positions, dim]
    in; [batch, positions, heads, dim] and no weights out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[2]
    block = query_block(length)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (not causal or attention_mask is not None or dropout or key.shape[2] != length or block is None
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    grouped = query.shape[1] != key.shape[1]
    blocks = []
    for start in range(0, length, block):
        end = min(start + block, length)
        keys, values = key[:, :, :end], value[:, :, :end]
        if start == 0:  # square: the kernel's own causal mask
            blocks.append(F.scaled_dot_product_attention(query[:, :, :end], keys, values, is_causal=True,
                                                         scale=scaling, enable_gqa=grouped))
            continue
        # query position start + r sees keys 0 .. start + r (is_causal would align the mask to the top left)
        visible = torch.arange(end, device=query.device) <= torch.arange(start, end, device=query.device)[:, None]
        blocks.append(F.scaled_dot_product_attention(query[:, :, start:end], keys, values, attn_mask=visible,
                                                     scale=scaling, enable_gqa=grouped))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


def apply_blocked_causal_attention(model) -> bool:
    """Give a transformers model configured for `sdpa` the blocked attention (under a name of its own, with sdpa's
    mask function); returns whether it did. Other implementations (eager, flex, a user's module) are left alone."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, blocked_causal_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    return True
