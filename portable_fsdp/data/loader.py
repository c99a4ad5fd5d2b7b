"""Pack token streams into fixed-length sequences and hand out deterministic, resumable batches.

Labels are shifted over the whole sequence here, once, before any backend shards a batch: each
sequence holds `seq_len + 1` tokens, inputs are the first `seq_len`, labels the last `seq_len`.
The batch for a step depends only on (seed, step), so resuming at step k replays exactly.

The token stream comes from the token cache (portable_fsdp/data/cache.py), memory-mapped: sequences are
strided views into it (consecutive ones share one token), read a batch at a time, so a process's memory does not
grow with the corpus. With data.streaming the corpus is read as it trains instead (portable_fsdp/data/streaming.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import socket

import numpy as np

from portable_fsdp.data.batch import EvalBatches, as_batch, release_pages
from portable_fsdp.data.sources import resolve_source
from portable_fsdp.data.tokenizers import load_checked_tokenizer, resolve_tokenizer
from portable_fsdp.errors import UserError, notify

ORDER_IN_MEMORY = 1 << 20  # epochs of fewer sequences are shuffled in memory; longer ones in a file beside the cache


@dataclasses.dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # [n_train, seq_len + 1], a read-only view of the cached stream (uint16 / uint32)
    eval: np.ndarray  # [n_eval, seq_len + 1]
    vocab_size: int
    eos_token_id: int
    # data.format=chat: 1 where a token is an assistant's (takes a loss), same shapes; None for text
    train_loss_mask: np.ndarray | None = None
    eval_loss_mask: np.ndarray | None = None
    cache: pathlib.Path | None = None  # the token cache's directory


def build_token_data(data_cfg, model_vocab_size: int, min_train_sequences: int, wait_s: float = 300.0) -> TokenData:
    """The packed sequences of data.source, from the token cache (built first when missing; `wait_s`: how long a
    rank other than node-local rank 0 waits for its builder's next sign of life)."""
    from portable_fsdp.data.cache import token_stream

    tokenizer = load_checked_tokenizer(data_cfg, model_vocab_size)
    stream = token_stream(data_cfg, resolve_source(data_cfg), tokenizer, wait_s)
    tokens = stream.tokens
    sequences = windows(tokens, data_cfg.seq_len)
    n_sequences = len(sequences)
    n_eval = max(1, int(n_sequences * data_cfg.eval_fraction))
    if n_sequences - n_eval < min_train_sequences:
        raise UserError("data.source", (
            f"{data_cfg.source} gives {len(tokens)} tokens = {n_sequences} sequences of data.seq_len="
            f"{data_cfg.seq_len}, too few for {n_eval} eval sequences and one global batch of "
            f"{min_train_sequences}; use more text or a shorter data.seq_len"))
    split = n_sequences - n_eval
    masks = windows(stream.loss_mask, data_cfg.seq_len) if stream.loss_mask is not None else None
    return TokenData(train=sequences[:split], eval=sequences[split:], vocab_size=tokenizer.vocab_size,
                     eos_token_id=tokenizer.eos_token_id,
                     train_loss_mask=None if masks is None else masks[:split],
                     eval_loss_mask=None if masks is None else masks[split:], cache=stream.path)


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """[n, seq_len + 1] read-only view of a flat stream: row i is tokens[i*seq_len : (i+1)*seq_len + 1].
    Consecutive windows overlap by one token, so every token is a label exactly once."""
    n = max(0, (len(tokens) - 1) // seq_len)
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=tokens.dtype)
    step = tokens.strides[0]
    return np.lib.stride_tricks.as_strided(tokens, shape=(n, seq_len + 1), strides=(seq_len * step, step),
                                           writeable=False)


def check_data(config, model_vocab_size: int) -> None:
    """Before any worker starts: the data can be read and gives one global batch and an eval split (and the token
    cache is built, so that the workers only map it). A run of train.epochs becomes one of train.steps here, from
    the same train split the workers read."""
    resolve_tokenizer(config)
    if config.data.streaming:
        from portable_fsdp.data.streaming import StreamingBatches

        StreamingBatches.check(config, model_vocab_size)
        return
    data = build_token_data(config.data, model_vocab_size, min_train_sequences=config.train.batch_size,
                            wait_s=config.train.collective_timeout_s)
    resolve_epochs(config.train, len(data.train))


def resolve_epochs(t, train_sequences: int) -> None:
    """train.epochs -> train.steps, with one line saying how many (a no-op once done, or for a run of steps)."""
    if t.epochs:
        steps = steps_for_epochs(t.epochs, train_sequences, t.batch_size)
        notify(f"train.epochs={t.epochs:g} is train.steps={steps}: {train_sequences} train sequences, "
               f"{t.batch_size} a step")
        t.steps, t.epochs = steps, 0.0


def steps_for_epochs(epochs: float, train_sequences: int, global_batch: int) -> int:
    """The steps that cover `epochs` passes as TrainBatches hands them out (the last may reach into the next
    epoch)."""
    return math.ceil(epochs * train_sequences / global_batch)


def open_data(config, model_vocab_size: int, dp_rank: int, dp_size: int) -> tuple:
    """(train batches, eval batches) of this data-parallel rank, as the training loop reads them."""
    resolve_tokenizer(config)  # a no-op after check_data; the Python API may come here first
    t = config.train
    if config.data.streaming:
        from portable_fsdp.data.streaming import StreamingBatches

        train = StreamingBatches(config, model_vocab_size)
        return train, train.eval_batches(t.eval_batch_size, dp_rank, dp_size, t.eval_max_batches)
    data = build_token_data(config.data, model_vocab_size, min_train_sequences=t.batch_size,
                            wait_s=t.collective_timeout_s)
    resolve_epochs(t, len(data.train))  # likewise
    documents_end_at = data.eos_token_id if config.data.document_masking else None
    train = TrainBatches(data.train, t.batch_size, t.grad_accum_steps, config.seed, documents_end_at,
                         loss_mask=data.train_loss_mask, order_dir=data.cache / "orders")
    evals = EvalBatches(data.eval, t.eval_batch_size, dp_rank, dp_size, t.eval_max_batches, documents_end_at,
                        loss_mask=data.eval_loss_mask)
    return train, evals


class TrainBatches:
    """Step `s` takes the global batch of sequences [s*B, (s+1)*B) of an endless stream of epochs,
    each a fresh permutation seeded by (seed, epoch). `order_dir`: where an epoch of more than ORDER_IN_MEMORY
    sequences keeps its permutation (the same one, shuffled in a memory-mapped file), so that a process's memory
    does not grow with the corpus; None = in memory."""

    def __init__(self, sequences: np.ndarray, global_batch: int, grad_accum: int, seed: int,
                 documents_end_at: int | None = None, loss_mask: np.ndarray | None = None,
                 order_dir: pathlib.Path | None = None):
        self.documents_end_at = documents_end_at
        self.sequences = sequences
        self.loss_mask = loss_mask
        self.global_batch = global_batch
        self.grad_accum = grad_accum
        self.seed = seed
        self.order_dir = order_dir
        self._perm_cache: dict = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            n = len(self.sequences)
            on_disk = self.order_dir is not None and n > ORDER_IN_MEMORY
            self._perm_cache = {epoch: shuffled_file(self.order_dir, self.seed, epoch, n) if on_disk
                                else np.random.default_rng([self.seed, epoch]).permutation(n)}
        return self._perm_cache[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        n = len(self.sequences)
        flat = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        indices = np.array([self._order(k // n)[k % n] for k in flat], dtype=np.int64)
        release_pages(*self._perm_cache.values())
        return indices

    def micro_batches(self, step: int, dp_rank: int, dp_size: int) -> list:
        """This rank's `grad_accum` micro-batches; micro-batch m of every rank together is a contiguous
        slice of the global batch, so the global batch does not depend on dp_size or grad_accum."""
        indices = self.global_indices(step)
        per_micro = self.global_batch // self.grad_accum
        per_rank = per_micro // dp_size
        batches = []
        for m in range(self.grad_accum):
            start = m * per_micro + dp_rank * per_rank
            rows = indices[start:start + per_rank]
            mask = None if self.loss_mask is None else self.loss_mask[rows]
            batches.append(as_batch(self.sequences[rows], self.documents_end_at, mask))
        release_pages(self.sequences, self.loss_mask)
        return batches

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / len(self.sequences)

    def state_at(self, step: int) -> dict | None:
        """What a checkpoint at `step` must keep to resume these batches: nothing, (seed, step) decides them."""
        return None

    def restore(self, checkpoint, step: int) -> None:
        """Continue from a checkpoint of step `step`: nothing to do, (seed, step) decides the batches."""


def shuffled_file(directory: pathlib.Path, seed: int, epoch: int, n: int) -> np.ndarray:
    """default_rng([seed, epoch]).permutation(n), memory-mapped from `directory` (shuffled there in place first by
    the first rank to need it: Generator.permutation(n) is Generator.shuffle(arange(n)), whatever the dtype)."""
    path = directory / f"order-seed{seed}-epoch{epoch}-n{n}.u32"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{socket.gethostname()}-{os.getpid()}")
        order = np.memmap(tmp, np.uint32, mode="w+", shape=(n,))
        for start in range(0, n, 1 << 20):  # 4 MB at a time
            order[start:start + (1 << 20)] = np.arange(start, min(n, start + (1 << 20)), dtype=np.uint32)
        np.random.default_rng([seed, epoch]).shuffle(order)
        order.flush()
        del order  # unmapped: its pages leave this process's resident set
        os.replace(tmp, path)
        for old in directory.glob(f"order-seed{seed}-epoch*-n{n}.u32"):  # epochs before the last one
            if int(old.name.split("-epoch")[1].split("-")[0]) < epoch - 1:
                old.unlink(missing_ok=True)
    return np.memmap(path, np.uint32, mode="r", shape=(n,))
