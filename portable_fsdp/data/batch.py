"""What a backend is handed: a `Batch` of token rows (inputs and labels shifted once, before any sharding), the
builder that cuts one from packed sequences (`as_batch`), and the eval split as `EvalBatches`, padded so that every
rank gets as many. Shared by the token cache's loader (loader.py) and the streaming reader (streaming.py)."""
from __future__ import annotations

import collections.abc
import dataclasses

import numpy as np

IGNORE_INDEX = -100
DATA_STATE = "data_state.json"  # in a checkpoint: where a streamed corpus was when it was saved


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


def as_batch(sequences: np.ndarray, documents_end_at: int | None = None, loss_mask: np.ndarray | None = None) -> Batch:
    """`documents_end_at`: the eos id, to keep packed documents apart (else one causal stream per row).
    `loss_mask`: 1 where a token takes a loss (chat data: assistant tokens), same shape as `sequences`."""
    rows = np.asarray(sequences, dtype=np.int64)  # the cache's uint16/uint32 rows as int64 ids
    # Copies, not views: inputs and labels of one row overlap in memory, and eval padding writes labels.
    batch = Batch(input_ids=rows[:, :-1].copy(), labels=rows[:, 1:].copy())
    if loss_mask is not None:
        batch.labels[np.asarray(loss_mask)[:, 1:] == 0] = IGNORE_INDEX
    if documents_end_at is None:
        return batch
    ends = batch.input_ids == documents_end_at
    segments = np.concatenate([np.zeros((len(ends), 1), np.int64), np.cumsum(ends, axis=1)[:, :-1]], axis=1)
    index = np.broadcast_to(np.arange(ends.shape[1]), ends.shape)
    starts = np.where(np.concatenate([np.ones((len(ends), 1), bool), ends[:, :-1]], axis=1), index, 0)
    positions = index - np.maximum.accumulate(starts, axis=1)
    batch.labels[ends] = IGNORE_INDEX  # an eos would predict the next document's first token, unseen
    return dataclasses.replace(batch, position_ids=positions, segment_ids=segments)


def release_pages(*arrays) -> None:
    """Unmap the pages a read of these memory-mapped arrays (or views of them) brought into this process: they stay in
    the page cache, shared and reclaimable, but no longer count in its resident set. Without it, each random row read
    maps the whole page-cache folio around it (up to 2 MB on recent kernels), and a process's resident set grows
    with the corpus: +350 MB per rank in 200 steps on 1 GB (docs/benchmarks.md)."""
    import mmap

    for array in arrays:
        while array is not None and not isinstance(array, np.memmap):
            array = getattr(array, "base", None)
        if array is not None and getattr(array, "_mmap", None) is not None and hasattr(mmap, "MADV_DONTNEED"):
            array._mmap.madvise(mmap.MADV_DONTNEED)


class EvalBatches(collections.abc.Sequence):
    """Every rank gets the same number of batches (collectives stay matched): the tail is padded with
    rows whose labels are all ignored, so they count for nothing. Each batch is cut from the sequences when
    asked for, so the eval split is never copied whole."""

    def __init__(self, sequences: np.ndarray, global_batch: int, dp_rank: int, dp_size: int, max_batches: int = 0,
                 documents_end_at: int | None = None, loss_mask: np.ndarray | None = None):
        self.sequences, self.loss_mask, self.documents_end_at = sequences, loss_mask, documents_end_at
        self.global_batch, self.per_rank, self.dp_rank = global_batch, global_batch // dp_size, dp_rank
        n_batches = -(-len(sequences) // global_batch)
        self.n_batches = min(n_batches, max_batches) if max_batches else n_batches
        self.keep = min(len(sequences), self.n_batches * global_batch)

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"eval batch {index} of {len(self)}")
        start = index * self.global_batch + self.dp_rank * self.per_rank
        real = min(max(self.keep - start, 0), self.per_rank)
        rows = np.zeros((self.per_rank, self.sequences.shape[1]), dtype=self.sequences.dtype)
        rows[:real] = self.sequences[start:start + real]
        mask = None
        if self.loss_mask is not None:
            mask = np.zeros(rows.shape, dtype=np.uint8)
            mask[:real] = self.loss_mask[start:start + real]
        batch = as_batch(rows, self.documents_end_at, mask)
        batch.labels[real:] = IGNORE_INDEX
        release_pages(self.sequences, self.loss_mask)
        return batch
