"""Wiring context parallelism into a transformers model and into each batch.

The model's attention is swapped through transformers' AttentionInterface (no model code is patched).
For each batch, `sequence_shard` cuts inputs, labels and position ids with the neutral split
(portable_fsdp.training.sequence_split) and tells the attention where its tokens sit in the full sequence.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from portable_fsdp.backends.torch.batch_layout import BatchLayout
from portable_fsdp.backends.torch.context_parallel.attention import ShardLayout, allgather_attention, ring_attention
from portable_fsdp.training.sequence_split import shard_indices

PORTABLE_ATTENTION = "portable_fsdp_cp"
TORCH_SDPA_ATTENTION = "portable_fsdp_torch_cp"

_active_layout = BatchLayout()  # read by the attention, wherever autograd runs it


@dataclasses.dataclass(frozen=True)
class CPGroup:
    group: object  # the cp ProcessGroup
    mesh: object  # the 1-D cp DeviceMesh (torch's context_parallel needs it)
    cp_rank: int
    cp_size: int
    rotate_method: str
    impl: str  # "portable" | "torch"
    load_balance: bool


def portable_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-interface signature; returns ([b, L, h, d], None)."""
    layout = _active_layout.get()
    if layout is None:
        raise RuntimeError("context-parallel attention ran outside sequence_shard(): the batch was not sharded")
    if attention_mask is not None:
        raise ValueError("context parallelism computes its own causal/document mask; a custom attention_mask "
                         "cannot be sharded — pass document boundaries as position_ids instead")
    if dropout:
        raise ValueError("attention dropout is not supported with context parallelism; set attention_dropout=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attend = allgather_attention if layout.rotate_method == "allgather" else ring_attention
    return attend(query, key, value, layout, scale).transpose(1, 2).contiguous(), None


def torch_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Plain causal SDPA, registered under its own name so transformers builds no mask from the (sharded,
    non-contiguous) position ids: torch's context_parallel needs is_causal=True and no mask."""
    if attention_mask is not None:
        raise ValueError("cp_impl=torch supports causal attention only; a custom attention_mask cannot be sharded")
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def apply_context_parallel(model, cp: CPGroup) -> None:
    from transformers import AttentionInterface

    name = PORTABLE_ATTENTION if cp.impl == "portable" else TORCH_SDPA_ATTENTION
    AttentionInterface.register(name, portable_attention if cp.impl == "portable" else torch_sdpa_attention)
    model.config._attn_implementation = name


@contextlib.contextmanager
def sequence_shard(cp: CPGroup | None, batch, device):
    """Yield this rank's (input_ids, labels, position_ids) tensors of `batch`; forward *and* backward must
    run inside (activation checkpointing recomputes attention during backward). Packed documents
    (batch.segment_ids) are honoured exactly by the portable attention."""
    if cp is None:  # transformers builds the document mask itself from restarting position ids
        yield _tensors(batch.input_ids, batch.labels, batch.position_ids, device)
        return
    if cp.impl == "torch":
        if batch.segment_ids is not None:
            raise ValueError("cp_impl=torch supports causal attention only, not packed-document masks")
        with _torch_context_parallel(cp, batch.input_ids, batch.labels, device) as tensors:
            yield tensors
        return
    seq_len = batch.input_ids.shape[1]
    index = [torch.from_numpy(shard_indices(seq_len, cp.cp_size, r, cp.load_balance)).to(device)
             for r in range(cp.cp_size)]
    mine = shard_indices(seq_len, cp.cp_size, cp.cp_rank, cp.load_balance)
    segments = None if batch.segment_ids is None else torch.from_numpy(batch.segment_ids[:, mine]).to(device)
    layout = ShardLayout(cp.group, cp.cp_rank, cp.cp_size, cp.rotate_method, tuple(index), segments)
    with _active_layout.active(layout):
        yield slice_batch(batch, mine, device)


def slice_batch(batch, mine, device):
    """(input_ids, labels, position_ids) tensors of the tokens at positions `mine` of every row of `batch` (the
    labels were shifted before: a slice keeps each token's own next-token label; positions stay global)."""
    positions = np.broadcast_to(mine, (len(batch.input_ids), len(mine))) if batch.position_ids is None \
        else batch.position_ids[:, mine]
    return _tensors(batch.input_ids[:, mine], None if batch.labels is None else batch.labels[:, mine],
                    positions, device)


def _tensors(input_ids, labels, position_ids, device):
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return as_tensor(input_ids), as_tensor(labels), as_tensor(position_ids)


@contextlib.contextmanager
def _torch_context_parallel(cp: CPGroup, input_ids, labels, device):
    """torch's experimental context_parallel shards the buffers in place (its own head-tail split)."""
    context_parallel, set_rotate_method = _torch_cp_api()
    set_rotate_method(cp.rotate_method)
    ids, lbl, _ = _tensors(input_ids, labels, None, device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids).contiguous()
    buffers = [ids, positions] + ([lbl] if lbl is not None else [])
    with context_parallel(cp.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)):
        yield ids, lbl, positions


def _torch_cp_api():
    """The module moved between torch 2.9 and later releases."""
    from torch.distributed.tensor.experimental import context_parallel

    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:
        from torch.distributed.tensor.experimental._context_parallel._attention import set_rotate_method
    return context_parallel, set_rotate_method
