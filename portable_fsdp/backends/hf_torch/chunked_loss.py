"""The output projection and the cross-entropy as one step, a chunk of tokens at a time: a training or eval loss
never holds the logits of a whole micro-batch (fp32 logits of a 128k vocabulary at 8k tokens are 4 GB per rank,
and autograd would keep them, their bf16 copy and their gradient).

The model's own output projection (transformers' `get_output_embeddings()`, `lm_head`, tied or not) is given
labels for the length of one model call (`labels_for`); its forward then returns, instead of logits, the token
losses summed per row and sequence part ([rows, parts], fp32). Everything runs inside the model's call, so
whatever wraps the model sees an ordinary forward: FSDP2's root hooks have gathered the projection's weight
(and its gradient is reduce-scattered after backward as any other), torch_xla's wrappers annotate the output
like logits (rows over the data-parallel devices, parts over cp|sp). Without labels (predictions) the
projection returns logits as before.

Each chunk's logits are computed, reduced to losses, and their gradient (softmax − one-hot) is turned at once
into the gradients of the hidden states and of the weight (and bias), which backward only scales: the same
three products as an unchunked forward and backward, no recomputation, and nothing for a compiler to fold
back into one big tensor. Chunks run along the sequence, each covering every row and every sequence part
(portable_fsdp/training/loss_chunks.py), so under SPMD (rows split over the data-parallel devices, positions over cp|sp)
every device computes its share of every chunk.

A model whose forward changes the logits after the projection (soft-capping, scaling) is left unchunked when
its config says so (LOGIT_TRANSFORMS); any other is caught on its first call (`loss_from`), never trained on a
wrong loss. On CUDA, Liger's fused linear-cross-entropy kernel replaces the chunk loop when liger-kernel is
installed (an optional dependency).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import types

import torch
import torch.nn.functional as F
from torch import nn

from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.errors import UserError
from portable_fsdp.training.loss_chunks import Chunking

# Config keys with which a transformers model changes its logits after lm_head (Gemma 2/3 soft-capping, Cohere's
# logit_scale, Granite's logits_scaling, a vocabulary padded beyond the tokenizer's): such a model keeps its
# unchunked loss.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                    "unpadded_vocab_size")
_STATE = "_portable_fsdp_chunked_loss"  # the ChunkedLoss an installed projection carries


@dataclasses.dataclass
class ChunkedLoss:
    """What an installed projection computes with labels: the loss cut by `chunking`, or by Liger's kernel
    (`fused`)."""

    chunking: Chunking
    fused: bool = False
    labels: torch.Tensor | None = None  # set for one model call by labels_for
    output: torch.Tensor | None = None  # what the projection returned then


def fused_kernel_available(device_type: str) -> bool:
    """Liger's fused linear-cross-entropy (Triton) runs on CUDA, when liger-kernel is installed."""
    return device_type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def install(model: nn.Module, chunking: Chunking, device_type: str) -> bool:
    """Make `model`'s output projection compute the loss in chunks when labels are given; returns whether it
    does. Not when `chunking.tokens` is 0, the projection is not a Linear, or the config transforms the logits.
    Call it after any wrapping that replaces the projection's weight (a projection split over the vocabulary by
    tensor parallelism keeps its vocabulary-parallel loss: leave it uninstalled)."""
    head = model.get_output_embeddings()
    if chunking.tokens <= 0 or not isinstance(head, nn.Linear) or transforms_logits(model.config):
        return False
    fused = fused_kernel_available(device_type) and chunking.sequence_parts == 1 and chunking.row_shards == 1
    setattr(head, _STATE, ChunkedLoss(chunking, fused))
    head.forward = types.MethodType(_forward, head)  # an instance attribute: hooks and wrappers stay around it
    return True


def transforms_logits(config) -> bool:
    """Whether the model's forward changes its logits after the projection (LOGIT_TRANSFORMS set)."""
    configs = [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    return any(getattr(c, key, None) is not None for c in configs for key in LOGIT_TRANSFORMS)


def installed(model: nn.Module) -> ChunkedLoss | None:
    """The ChunkedLoss of `model`'s projection (found through any wrapper around the model), or None."""
    for module in model.modules():
        state = getattr(module, _STATE, None)
        if isinstance(state, ChunkedLoss):
            return state
    return None


@contextlib.contextmanager
def labels_for(state: ChunkedLoss | None, labels: torch.Tensor):
    """Around one model call: the projection returns token-loss sums of `labels` instead of logits."""
    if state is None:
        yield
        return
    state.labels, state.output = labels, None
    try:
        yield
    finally:
        state.labels = None


def loss_from(state: ChunkedLoss, model: nn.Module, logits) -> torch.Tensor:
    """Σ token losses from what the model returned as logits: the projection's own output, or an error naming
    the fix when the model's forward changed it on the way out."""
    output, state.output = state.output, None
    if output is None or logits is not output:
        name = type(getattr(model, "module", model)).__name__
        raise UserError("train.loss_chunk_tokens", (
            f"{name} changes its logits after its output projection, so the loss cannot be computed in chunks "
            "inside it; set train.loss_chunk_tokens=0"))
    return output.sum()


def _forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    state: ChunkedLoss = getattr(head, _STATE)
    if state.labels is None:
        return type(head).forward(head, hidden)
    if state.fused:
        output = fused_loss_sum(hidden, head.weight, head.bias, state.labels).reshape(1, 1)
    else:
        output = chunked_loss_sums(hidden, head.weight, head.bias, state.labels, state.chunking)
    state.output = output
    return output


def fused_loss_sum(hidden, weight, bias, labels) -> torch.Tensor:
    """Σ token losses by Liger's fused linear-cross-entropy kernel (CUDA)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    return loss(weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), bias).float()


def chunked_loss_sums(hidden, weight, bias, labels, chunking: Chunking) -> torch.Tensor:
    """Token-loss sums [rows, sequence parts] of hidden [rows, seq, features] under `labels` [rows, seq]."""
    rows, seq, features = hidden.shape
    parts = chunking.sequence_parts
    hidden = hidden.reshape(rows, parts, seq // parts, features)
    labels = labels.reshape(rows, parts, seq // parts)
    chunk = chunking.positions(rows, seq // parts)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk)
    with torch.no_grad():
        return _chunk_loop(hidden, weight, bias, labels, chunk, None)


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden [rows, parts, positions, features] -> token-loss sums [rows, parts]; the gradients are computed in
    forward, a chunk at a time, and scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        grads = _Gradients.like(hidden, weight, bias)
        sums = _chunk_loop(hidden, weight, bias, labels, chunk, grads)
        ctx.save_for_backward(grads.hidden, grads.weight, grads.bias)
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # Each row-part's tokens scale by its incoming gradient (in place: the buffers are this node's alone). The
        # weight's and bias's gradients were summed over every row-part: exact for the one use of the output,
        # its plain sum (loss_from), where the incoming gradient is the same everywhere.
        wanted = ctx.needs_input_grad
        grad_hidden = grad_hidden.mul_(grad_sums.to(grad_hidden.dtype)[:, :, None, None]) if wanted[0] else None
        uniform = grad_sums.mean()
        grad_weight = grad_weight.mul_(uniform.to(grad_weight.dtype)) if wanted[1] else None
        grad_bias = grad_bias.mul_(uniform.to(grad_bias.dtype)) if grad_bias is not None and wanted[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


@dataclasses.dataclass
class _Gradients:
    """What the chunk loop fills, each in its tensor's dtype (what autograd would make in backward, so nothing
    held from forward to backward outweighs what an unchunked backward allocates; the weight's summed over chunks
    in place, as Liger's kernel does)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def like(cls, hidden, weight, bias):
        return cls(torch.empty_like(hidden), torch.zeros_like(weight),
                   torch.zeros_like(bias) if bias is not None else None)


def _chunk_loop(hidden, weight, bias, labels, chunk: int, grads: _Gradients | None) -> torch.Tensor:
    """Σ token losses per [row, part], a chunk of positions at a time; with `grads`, each chunk's gradients (of
    the plain sum of its token losses) added to them."""
    rows, parts, positions, _ = hidden.shape
    sums = hidden.new_zeros((rows, parts), dtype=torch.float32)
    for start in range(0, positions, chunk):
        h = hidden[:, :, start:start + chunk]
        target = labels[:, :, start:start + chunk]
        valid = target != IGNORE_INDEX
        safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(-1)
        logits = F.linear(h, weight, bias).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        sums = sums + ((lse - logits.gather(-1, safe)).squeeze(-1) * valid).sum(dim=-1)
        if grads is not None:
            _add_chunk_gradients(grads, logits, lse, safe, valid, h, weight, start)
    return sums


def _add_chunk_gradients(grads: _Gradients, logits, lse, safe, valid, h, weight, start: int) -> None:
    """d Σ(lse − picked) / d logits = softmax − one-hot (zero for ignored tokens), in the logits' memory, then
    through the projection: into the hidden states' slice and the weight's (and bias's) sums."""
    probs = logits.sub_(lse).exp_()
    probs.scatter_add_(-1, safe, -torch.ones_like(safe, dtype=probs.dtype))
    grad_logits = probs.mul_(valid.unsqueeze(-1)).to(h.dtype)
    grads.hidden[:, :, start:start + h.shape[2]] = grad_logits @ weight
    flat_grad, flat_hidden = grad_logits.reshape(-1, grad_logits.shape[-1]), h.reshape(-1, h.shape[-1])
    if grad_logits.dtype == grads.weight.dtype and not _autocast(h.device.type):
        grads.weight.addmm_(flat_grad.t(), flat_hidden)  # in place: no weight-sized temporary
    else:  # autocast's product in its compute dtype, summed in the weight's
        grads.weight += flat_grad.t() @ flat_hidden
    if grads.bias is not None:
        grads.bias += flat_grad.sum(dim=0)


def _autocast(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False
