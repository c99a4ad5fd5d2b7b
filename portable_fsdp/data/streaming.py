"""data.streaming: a corpus too large for the disk, read as an `IterableDataset`, tokenised and packed while training.

The stream is cut as the token cache's is (windows of seq_len + 1 tokens, consecutive ones sharing one), in corpus
order: its first data.eval_sequences windows are the eval split, then step s takes the next global batch, and at
the end of the corpus the next epoch starts again after the eval windows. Every rank reads the whole stream and
keeps its own rows, so the global batch does not depend on the number of ranks. A checkpoint records where the
stream stood (`data_state.json`: epoch, document, token offset in it); a resume skips the documents before it
without tokenising them and continues from that token.
"""
from __future__ import annotations

import json
import pathlib
import typing

import numpy as np

from portable_fsdp.data.batch import DATA_STATE, EvalBatches, as_batch

from portable_fsdp.data.tokenizers import load_checked_tokenizer
from portable_fsdp.data.rows import RowEncoder
from portable_fsdp.data.sources import BadRow, open_dataset, resolve_source, source_error
from portable_fsdp.errors import UserError

ROWS_PER_READ = 64


class Position(typing.NamedTuple):
    epoch: int
    document: int  # documents (rows) of the corpus before the next window's first token
    offset: int  # that token's index within its document's ids


class StreamingBatches:
    """The TrainBatches of a streamed corpus: `micro_batches(step, dp_rank, dp_size)` for steps in order (the last
    step may be asked again, by every rank of the process), `state_at(step)` / `restore(checkpoint, step)`."""

    def __init__(self, config, model_vocab_size: int):
        d, t = config.data, config.train
        self.tokenizer = load_checked_tokenizer(d, model_vocab_size)
        self.source = resolve_source(d)
        self.seq_len, self.eval_sequences = d.seq_len, d.eval_sequences
        self.global_batch, self.grad_accum, self.seed = t.batch_size, t.grad_accum_steps, config.seed
        self.documents_end_at = self.tokenizer.eos_token_id if d.document_masking else None
        self.encoder = RowEncoder(self.tokenizer.spec, self.source.column, self.source.chat,
                                  skip_empty=self.source.kind not in ("bundled", "text"))
        self.identity = {"source": self.source.identity(), "tokenizer": self.tokenizer.identity(),
                         "format": d.format, "column": self.source.column, "seq_len": d.seq_len,
                         "eval_sequences": d.eval_sequences}
        self._dataset = open_dataset(self.source, streaming=True)
        first_pass = self._epoch_windows(Position(0, 0, 0))
        held_out = [window for _, window in zip(range(self.eval_sequences), first_pass)]
        if len(held_out) < self.eval_sequences:
            self._too_few(len(held_out))
        self.eval_rows = np.stack([w[0] for w in held_out])
        self.eval_mask = np.stack([w[1] for w in held_out]) if self.source.chat else None
        self.train_start = held_out[-1][2]  # every epoch trains from here
        self._windows = self._pack(self.train_start)
        self._positions = {0: self.train_start}
        self._next_step = 0
        self._last = None  # (step, rows, masks) of the last global batch

    @classmethod
    def check(cls, config, model_vocab_size: int) -> None:
        """Before any worker starts: the stream gives the eval windows and a first global batch."""
        cls(config, model_vocab_size).micro_batches(0, 0, 1)

    def eval_batches(self, global_batch: int, dp_rank: int, dp_size: int, max_batches: int = 0) -> EvalBatches:
        return EvalBatches(self.eval_rows, global_batch, dp_rank, dp_size, max_batches, self.documents_end_at,
                           self.eval_mask)

    def micro_batches(self, step: int, dp_rank: int, dp_size: int) -> list:
        rows, masks = self._global_batch(step)
        per_micro = self.global_batch // self.grad_accum
        per_rank = per_micro // dp_size
        batches = []
        for m in range(self.grad_accum):
            start = m * per_micro + dp_rank * per_rank
            mask = None if masks is None else masks[start:start + per_rank]
            batches.append(as_batch(rows[start:start + per_rank], self.documents_end_at, mask))
        return batches

    def epoch_of(self, step: int) -> float:
        return float(self._positions.get(step, self._positions[max(self._positions)]).epoch)

    def state_at(self, step: int) -> dict:
        """Where the stream stands before step `step` (once step - 1 was read)."""
        return {"step": step, **self._positions[step]._asdict(), "identity": self.identity}

    def restore(self, checkpoint, step: int) -> None:
        path = pathlib.Path(checkpoint) / DATA_STATE
        if not path.is_file():
            raise UserError("train.resume", (
                f"{checkpoint} holds no {DATA_STATE}: it was not saved by a data.streaming run, so where the stream "
                "stood is unknown; resume it with data.streaming=false, or start a new workdir"))
        state = json.loads(path.read_text())
        if state["identity"] != self.identity:
            changed = sorted(k for k in self.identity if state["identity"].get(k) != self.identity[k])
            raise UserError("data.source", (
                f"{checkpoint} streamed other data ({', '.join(changed)} differ from this run's), so its position "
                "means nothing here; resume with the data settings it was saved with"))
        position = Position(state["epoch"], state["document"], state["offset"])
        self._windows = self._pack(position)
        self._positions = {step: position}
        self._next_step, self._last = step, None

    # ------------------------------------------------------------ the stream

    def _global_batch(self, step: int) -> tuple:
        if self._last is not None and self._last[0] == step:
            return self._last[1:]
        if step < self._next_step:
            raise ValueError(f"streamed batches are read in order: step {step} was read already (next: "
                             f"{self._next_step})")
        while self._next_step <= step:
            taken = [next(self._windows) for _ in range(self.global_batch)]
            if self._next_step == 0 and taken[-1][2].epoch > 0:  # one pass did not fill the first batch
                self._too_few(self.eval_sequences + sum(w[2].epoch == 0 for w in taken))
            rows = np.stack([w[0] for w in taken])
            masks = np.stack([w[1] for w in taken]) if self.source.chat else None
            self._next_step += 1
            self._positions[self._next_step] = taken[-1][2]
            for old in [s for s in self._positions if s < self._next_step - 2]:
                del self._positions[old]
            self._last = (self._next_step - 1, rows, masks)
        return self._last[1:]

    def _pack(self, start: Position):
        """Endless training windows from `start`; at the end of the corpus the next epoch starts again at the
        first training window."""
        position = start
        while True:
            produced = 0
            for window in self._epoch_windows(position):
                produced += 1
                yield window
            if not produced and position.document == self.train_start.document \
                    and position.offset == self.train_start.offset:
                self._too_few(self.eval_sequences)
            position = self.train_start._replace(epoch=position.epoch + 1)

    def _epoch_windows(self, start: Position):
        """(tokens [seq_len + 1], loss mask or None, position of the next window) to the end of the corpus."""
        width = self.seq_len + 1
        buffer, mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        segments = []  # [document, offset in it of its first token in the buffer, its tokens in the buffer]
        for index, ids, ids_mask in self._documents(start.document):
            first = start.offset if index == start.document else 0
            ids = ids[first:]
            if not len(ids):
                continue
            buffer = np.concatenate([buffer, ids])
            if ids_mask is not None:
                mask = np.concatenate([mask, ids_mask[first:]])
            segments.append([index, first, len(ids)])
            while len(buffer) >= width:
                window = buffer[:width].copy()
                window_mask = mask[:width].copy() if ids_mask is not None else None
                buffer, mask = buffer[self.seq_len:], mask[self.seq_len:]
                drop = self.seq_len
                while drop:
                    take = min(drop, segments[0][2])
                    segments[0][1] += take
                    segments[0][2] -= take
                    drop -= take
                    if not segments[0][2]:
                        segments.pop(0)
                yield window, window_mask, Position(start.epoch, segments[0][0], segments[0][1])

    def _documents(self, first: int):
        """(row index, ids, loss mask or None) of every document from row `first` on."""
        dataset = self._dataset.skip(first) if first else self._dataset
        index = first
        try:
            for rows in dataset.iter(batch_size=ROWS_PER_READ):
                values = rows[self.source.column]
                numbers = range(index, index + len(values))
                ids, masks = self.encoder.encode(values, numbers)
                for number, row_ids, k in zip(numbers, ids, range(len(ids))):
                    yield number, row_ids, None if masks is None else masks[k]
                index += len(values)
        except BadRow as err:
            raise UserError("data.source", f"{self.source.describe()}: row {err.row} {err.problem}") from None
        except UserError:
            raise
        except (UnicodeDecodeError, OSError, ValueError) as err:
            raise source_error(self.source, err) from None

    def _too_few(self, windows: int) -> None:
        raise UserError("data.source", (
            f"{self.source.describe()} gives {windows} sequences of data.seq_len={self.seq_len} in one pass, too few "
            f"for data.eval_sequences={self.eval_sequences} eval sequences and one global batch of "
            f"{self.global_batch}; use more text, fewer eval sequences or a shorter data.seq_len"))
