"""Ulysses sequence parallelism for the torch lowering: each rank of an sp group holds a contiguous slice of every
sequence; around attention an all-to-all turns "my tokens, every head" into "every token, my heads", the model's
own attention (SDPA or eager) runs over the whole sequence on those heads, and a second all-to-all turns the
result back. Everything outside attention (projections, MLP, norms, the loss) sees only this rank's tokens.

The attention is swapped through transformers' AttentionInterface, as context parallelism does; the batch is cut
by the same machinery (portable_fsdp.training.sequence_split.shard_indices, contiguous slices). As the attention is not
registered for transformers' mask builders, the model passes no mask: the one over the whole sequence is built
here from global token indices — causal, packed documents kept apart (the batch's segment ids), the layer's
sliding window — and none at all for plain causal SDPA, which then takes its is_causal kernels.

Heads (and key/value heads) must divide by sp_size (checked at start-up, portable_fsdp/mesh_fit.py). Under tensor
parallelism too, a tp rank may hold fewer key/value heads than sp_size (2 kv heads, tp 2, sp 2): its key/value
heads are then repeated — each copy serving its share of the query heads — until every sp rank gets whole ones,
as DeepSpeed's Ulysses does. DeepSpeed's
Ulysses (ALST) is not used: it is published as a source distribution only and pulls in deepspeed.comm; the two
all-to-alls below are the whole algorithm.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys

import torch
import torch.distributed as dist

from portable_fsdp.backends.torch.batch_layout import BatchLayout
from portable_fsdp.backends.torch.context_parallel import slice_batch
from portable_fsdp.training.sequence_split import shard_indices

ULYSSES_ATTENTION = "portable_fsdp_ulysses_{inner}"

_active_layout = BatchLayout()  # read by the attention, wherever autograd runs it


@dataclasses.dataclass(frozen=True)
class SPGroup:
    group: object  # the sp ProcessGroup
    sp_rank: int
    sp_size: int


@dataclasses.dataclass
class SPLayout:
    """What the attention of one batch needs: the group, and the batch's document ids over the whole sequence."""

    group: object
    sp_size: int
    segments: torch.Tensor | None  # [b, L] document ids, or None for one document per row
    masks: dict = dataclasses.field(default_factory=dict)  # (sliding window, dtype or None) -> mask, per batch

    def mask(self, seq_len: int, window: int | None, additive_dtype: torch.dtype | None, device):
        """Whether query i may attend key j over the whole sequence: [b|1, 1, L, L] booleans, or additive floats
        in `additive_dtype` (eager attention); None for plain causal boolean attention (SDPA's is_causal)."""
        if self.segments is None and not window and additive_dtype is None:
            return None
        key = (window, additive_dtype)
        if key not in self.masks:
            index = torch.arange(seq_len, device=device)
            allowed = index[None, :] <= index[:, None]
            if window:
                allowed &= index[:, None] - index[None, :] < window
            allowed = allowed[None, None]
            if self.segments is not None:
                allowed = allowed & (self.segments[:, None, :, None] == self.segments[:, None, None, :])
            if additive_dtype is not None:
                allowed = torch.zeros(allowed.shape, dtype=additive_dtype, device=device).masked_fill(
                    ~allowed, torch.finfo(additive_dtype).min)
            self.masks[key] = allowed
        return self.masks[key]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (chunk i goes to group rank i); its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[b, h, L/sp, d] (this rank's tokens, every head) -> [b, h/sp, L, d] (every token, this rank's heads)."""
    b, h, local, d = x.shape
    chunks = x.reshape(b, size, h // size, local, d).permute(1, 0, 2, 3, 4)  # [dest rank, b, h/sp, L/sp, d]
    received = _AllToAll.apply(chunks, group)  # [source rank = its tokens, b, h/sp, L/sp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * local, d)


def heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[b, L, h/sp, d] (every token, this rank's heads) -> [b, L/sp, h, d] (this rank's tokens, every head)."""
    b, length, heads, d = x.shape
    chunks = x.reshape(b, size, length // size, heads, d).permute(1, 0, 2, 3, 4)  # [dest rank, b, L/sp, h/sp, d]
    received = _AllToAll.apply(chunks, group)  # [source rank = its heads, b, L/sp, h/sp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, length // size, size * heads, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, inner: str,
                      **kwargs):
    """transformers' attention-interface signature: q [b, h, L/sp, d], k/v [b, hkv, L/sp, d] of this rank's
    tokens; returns ([b, L/sp, h, d], None)."""
    layout = _active_layout.get()
    if layout is None:
        raise RuntimeError("sequence-parallel attention ran outside sequence_shard(): the batch was not sharded")
    if attention_mask is not None:
        raise ValueError("sequence parallelism builds its own causal/document mask; a custom attention_mask "
                         "cannot be sharded — pass document boundaries as position_ids instead")
    group, size = layout.group, layout.sp_size
    key, value, module = _enough_kv_heads(key, value, module, query.shape[1], size)
    q, k, v = (sequence_to_heads(t, group, size) for t in (query, key, value))
    attend = _inner_attention(module, inner)
    mask = layout.mask(q.shape[2], kwargs.pop("sliding_window", None),
                       None if inner == "sdpa" else q.dtype, q.device)
    out, _ = attend(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    return heads_to_sequence(out, group, size), None


class _Regrouped:
    """The attention module as the inner attention sees it, with fewer query heads per key/value head."""

    def __init__(self, module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _enough_kv_heads(key, value, module, query_heads: int, size: int):
    """Key/value heads repeated r times (the fewest that split over `size` ranks; r divides the query heads per
    key/value head, so each copy serves a contiguous share of them), and the module seen with that grouping."""
    kv_heads = key.shape[1]
    if kv_heads % size == 0:
        return key, value, module
    r = size // math.gcd(kv_heads, size)
    key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    return key, value, _Regrouped(module, query_heads // (kv_heads * r))


def _inner_attention(module, inner: str):
    """The model's own attention function: SDPA from transformers' registry, eager from the model's module."""
    if inner == "eager":
        owner = module._module if isinstance(module, _Regrouped) else module
        return sys.modules[type(owner).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def apply_sequence_parallel(model, sp: SPGroup) -> None:
    from transformers import AttentionInterface

    inner = model.config._attn_implementation
    if inner not in ("sdpa", "eager"):
        raise ValueError(f"sequence parallelism wraps sdpa or eager attention, not {inner!r}; set "
                         "model.attn_implementation=sdpa")
    name = ULYSSES_ATTENTION.format(inner=inner)
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=inner))
    model.config._attn_implementation = name


@contextlib.contextmanager
def sequence_shard(sp: SPGroup, batch, device):
    """Yield this rank's (input_ids, labels, position_ids) of `batch`, a contiguous slice of every row; forward
    *and* backward must run inside (activation checkpointing re-runs attention during backward)."""
    mine = shard_indices(batch.input_ids.shape[1], sp.sp_size, sp.sp_rank, load_balance=False)
    segments = None if batch.segment_ids is None else torch.from_numpy(batch.segment_ids).to(device)
    with _active_layout.active(SPLayout(sp.group, sp.sp_size, segments)):
        yield slice_batch(batch, mine, device)
