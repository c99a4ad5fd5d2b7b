"""The Flax lowering's token loss: Σ cross-entropy over label tokens, in float32 — from logits (predictions'
path, small batches), or from the final hidden states and the output projection a chunk of tokens at a time
(`chunked_token_loss_sum`: training and eval), so a step never holds a whole micro-batch's logits.

Chunks are cut as portable_fsdp.training.loss_chunks says (every row and sequence part, a run of positions: under SPMD
each device computes its share of every chunk) and a `lax.scan` runs over them; each chunk's projection and loss
are rematerialised (`jax.checkpoint`), so backward recomputes one chunk's logits at a time instead of keeping
them all.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.training.loss_chunks import Chunking


def token_loss_sum(logits, labels):
    """Σ cross-entropy over label tokens (IGNORE_INDEX excluded), in float32."""
    logits = logits.astype(jnp.float32)
    valid = labels != IGNORE_INDEX
    # A one-hot product rather than take_along_axis: exact all the same (one term is non-zero), and its
    # gradient is elementwise where a gather's is a scatter, which XLA cannot partition along rows and cp.
    picked = jnp.sum(logits * jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jnp.sum(jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0))


@jax.checkpoint
def _chunk_loss(hidden, kernel, labels):
    return token_loss_sum(hidden @ kernel, labels)


def chunked_token_loss_sum(hidden, kernel, labels, chunking: Chunking):
    """Σ token losses of hidden [rows, seq, features] projected by kernel [features, vocab], under labels
    [rows, seq]: the same number as token_loss_sum(hidden @ kernel, labels), one chunk's logits at a time."""
    rows, seq, features = hidden.shape
    parts = chunking.sequence_parts
    positions = seq // parts
    chunk, count = chunking.positions(rows, positions), chunking.count(rows, positions)
    pad = count * chunk - positions  # the last chunk padded with ignored tokens
    hidden = jnp.pad(hidden.reshape(rows, parts, positions, features), ((0, 0), (0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels.reshape(rows, parts, positions), ((0, 0), (0, 0), (0, pad)), constant_values=IGNORE_INDEX)
    # [chunks, rows, parts, chunk positions, ...]: the scan runs over the leading axis, which no device splits
    hidden = jnp.moveaxis(hidden.reshape(rows, parts, count, chunk, features), 2, 0)
    labels = jnp.moveaxis(labels.reshape(rows, parts, count, chunk), 2, 0)

    def add_chunk(total, chunk_inputs):
        chunk_hidden, chunk_labels = chunk_inputs
        return total + _chunk_loss(chunk_hidden, kernel, chunk_labels), None

    total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), (hidden, labels))
    return total
