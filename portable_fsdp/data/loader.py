"""Pack token streams into fixed-length sequences and hand out deterministic, resumable batches.

Labels are shifted over the whole sequence here, once, before any backend shards a batch: each
sequence holds `seq_len + 1` tokens, inputs are the first `seq_len`, labels the last `seq_len`.
The batch for a step depends only on (seed, step), so resuming at step k replays exactly.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from portable_fsdp.data.sources import read_documents
from portable_fsdp.data.tokenizers import load_tokenizer
from portable_fsdp.errors import UserError

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: np.ndarray  # [b, seq_len] int64
    labels: np.ndarray | None  # [b, seq_len] int64, IGNORE_INDEX where no loss is taken; None to predict only
    # With data.document_masking: position within its document, and the document's number in the row.
    position_ids: np.ndarray | None = None
    segment_ids: np.ndarray | None = None

    @property
    def num_label_tokens(self) -> int:
        return 0 if self.labels is None else int((self.labels != IGNORE_INDEX).sum())


@dataclasses.dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # [n_train, seq_len + 1]
    eval: np.ndarray  # [n_eval, seq_len + 1]
    vocab_size: int
    eos_token_id: int


def build_token_data(data_cfg, model_vocab_size: int, min_train_sequences: int) -> TokenData:
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError("model.vocab_size", (
            f"{model_vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids; token ids would "
            f"index past the embedding: set model.vocab_size >= {tokenizer.vocab_size}"))
    tokens = tokenizer.encode_documents(read_documents(data_cfg.source, data_cfg.text_column))
    window = data_cfg.seq_len + 1
    n_sequences = max(0, (len(tokens) - 1) // data_cfg.seq_len)
    n_eval = max(1, int(n_sequences * data_cfg.eval_fraction))
    if n_sequences - n_eval < min_train_sequences:
        raise UserError("data.source", (
            f"{data_cfg.source} gives {len(tokens)} tokens = {n_sequences} sequences of data.seq_len="
            f"{data_cfg.seq_len}, too few for {n_eval} eval sequences and one global batch of "
            f"{min_train_sequences}; use more text or a shorter data.seq_len"))
    # Consecutive windows overlap by one token, so every token is a label exactly once.
    starts = np.arange(n_sequences) * data_cfg.seq_len
    sequences = tokens[starts[:, None] + np.arange(window)[None, :]].astype(np.int64)
    return TokenData(train=sequences[: n_sequences - n_eval], eval=sequences[n_sequences - n_eval:],
                     vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)


def _as_batch(sequences: np.ndarray, documents_end_at: int | None = None) -> Batch:
    """`documents_end_at`: the eos id, to keep packed documents apart (else one causal stream per row)."""
    # Copies, not views: inputs and labels of one row overlap in memory, and eval padding writes labels.
    batch = Batch(input_ids=sequences[:, :-1].copy(), labels=sequences[:, 1:].copy())
    if documents_end_at is None:
        return batch
    ends = batch.input_ids == documents_end_at
    segments = np.concatenate([np.zeros((len(ends), 1), np.int64), np.cumsum(ends, axis=1)[:, :-1]], axis=1)
    index = np.broadcast_to(np.arange(ends.shape[1]), ends.shape)
    starts = np.where(np.concatenate([np.ones((len(ends), 1), bool), ends[:, :-1]], axis=1), index, 0)
    positions = index - np.maximum.accumulate(starts, axis=1)
    batch.labels[ends] = IGNORE_INDEX  # an eos would predict the next document's first token, unseen
    return dataclasses.replace(batch, position_ids=positions, segment_ids=segments)


class TrainBatches:
    """Step `s` takes the global batch of sequences [s*B, (s+1)*B) of an endless stream of epochs,
    each a fresh permutation seeded by (seed, epoch)."""

    def __init__(self, sequences: np.ndarray, global_batch: int, grad_accum: int, seed: int,
                 documents_end_at: int | None = None):
        self.documents_end_at = documents_end_at
        self.sequences = sequences
        self.global_batch = global_batch
        self.grad_accum = grad_accum
        self.seed = seed
        self._perm_cache: dict = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))}
        return self._perm_cache[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        n = len(self.sequences)
        flat = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        return np.array([self._order(k // n)[k % n] for k in flat])

    def micro_batches(self, step: int, dp_rank: int, dp_size: int) -> list:
        """This rank's `grad_accum` micro-batches; micro-batch m of every rank together is a contiguous
        slice of the global batch, so the global batch does not depend on dp_size or grad_accum."""
        indices = self.global_indices(step)
        per_micro = self.global_batch // self.grad_accum
        per_rank = per_micro // dp_size
        batches = []
        for m in range(self.grad_accum):
            start = m * per_micro + dp_rank * per_rank
            batches.append(_as_batch(self.sequences[indices[start:start + per_rank]], self.documents_end_at))
        return batches

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / len(self.sequences)


def eval_batches(sequences: np.ndarray, global_batch: int, dp_rank: int, dp_size: int, max_batches: int = 0,
                 documents_end_at: int | None = None) -> list:
    """Every rank gets the same number of batches (collectives stay matched): the tail is padded with
    rows whose labels are all ignored, so they count for nothing."""
    n_batches = -(-len(sequences) // global_batch)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    padded = np.zeros((n_batches * global_batch, sequences.shape[1]), dtype=sequences.dtype)
    keep = min(len(sequences), len(padded))
    padded[:keep] = sequences[:keep]
    batches = []
    per_rank = global_batch // dp_size
    for b in range(n_batches):
        start = b * global_batch + dp_rank * per_rank
        batch = _as_batch(padded[start:start + per_rank], documents_end_at)
        pad_rows = np.arange(start, start + per_rank) >= keep
        batch.labels[pad_rows] = IGNORE_INDEX
        batches.append(batch)
    return batches
