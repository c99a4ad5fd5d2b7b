"""Rows -> token ids: one document (or conversation) per row, checked, then the tokenizer's ids and the end-of-document
id; for chat rows also a loss mask (1 = an assistant token). The same code serves `Dataset.map` (the token cache,
one copy per worker process) and the streaming packer."""
from __future__ import annotations

import numpy as np

from portable_fsdp.data.sources import BadRow
from portable_fsdp.data.tokenizers import load_tokenizer


class RowEncoder:
    """`Dataset.map(encoder, batched=True, with_indices=True)` over an arrow-formatted dataset: a table of rows ->
    a table of `input_ids` (and `loss_mask` for chat). Holds the tokenizer's spec, not the tokenizer: each worker
    process loads its own. `skip_empty`: an empty text gives no tokens (a `datasets` source, as before the cache);
    otherwise it is a document of its own (bundled and text-file documents are never empty)."""

    def __init__(self, tokenizer_spec: str, column: str, chat: bool, skip_empty: bool, id_type: str = "int32"):
        self.tokenizer_spec, self.column, self.chat, self.skip_empty = tokenizer_spec, column, chat, skip_empty
        self.id_type = id_type  # of the Arrow table's ids: the cache's dtype, so the table is no larger than it
        self._tokenizer = None

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_spec)
        return self._tokenizer

    def __call__(self, batch, indices):
        """An Arrow table of rows (text) -> an Arrow table; a dict of columns (chat, decoded by `datasets`) -> a dict."""
        import pyarrow as pa

        if not isinstance(batch, pa.Table):
            ids, masks = self.encode(batch[self.column], indices)
            return {"input_ids": ids, "loss_mask": masks} if masks is not None else {"input_ids": ids}
        ids, masks = self.encode(_column_values(batch.column(self.column), indices), indices)
        table = {"input_ids": _list_array(ids, pa.from_numpy_dtype(np.dtype(self.id_type)))}
        if masks is not None:
            table["loss_mask"] = _list_array(masks, pa.uint8())
        return pa.table(table)

    def encode(self, values: list, rows) -> tuple:
        """(ids, masks): one int32 array per row (empty for a skipped row); masks None for text."""
        if self.chat:
            return self._encode_chats(values, rows)
        for value, row in zip(values, rows):
            if not isinstance(value, str):
                raise BadRow(row, not_text(value, self.column))
        keep = [bool(value) or not self.skip_empty for value in values]
        encoded = iter(self.tokenizer.encode_each([value for value, k in zip(values, keep) if k]))
        return [next(encoded) if k else np.zeros(0, np.int32) for k in keep], None

    def _encode_chats(self, values: list, rows) -> tuple:
        ids, masks = [], []
        for value, row in zip(values, rows):
            _check_messages(value, row, self.column)
            if not value:
                ids.append(np.zeros(0, np.int32))
                masks.append(np.zeros(0, np.uint8))
                continue
            try:
                ((row_ids, row_mask),) = self.tokenizer.encode_chats([value])
            except BadRow:
                raise
            except Exception as err:  # the template's own error (e.g. roles that must alternate)
                raise BadRow(row, f"the chat template cannot render it ({str(err).splitlines()[0]})") from None
            ids.append(row_ids)
            masks.append(row_mask)
        return ids, masks


def not_text(value, column: str) -> str:
    if value is None:
        return f"has no text in column {column!r} (null); drop the row or give it text"
    return f"holds {type(value).__name__} {str(value)[:40]!r} in column {column!r}, not text"


def _check_messages(value, row: int, column: str) -> None:
    if not isinstance(value, list):
        raise BadRow(row, f"column {column!r} holds {type(value).__name__}, not a list of messages "
                     "({role, content})")
    for k, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise BadRow(row, f"message {k} of column {column!r} is {str(message)[:60]!r}, not "
                         "{'role': str, 'content': str}")


def _column_values(column, indices) -> list:
    """The column as Python values; a value whose bytes are not UTF-8 raises BadRow naming its row."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        for i, row in enumerate(indices):
            try:
                column[i].as_py()
            except UnicodeDecodeError:
                raise BadRow(row, "is not UTF-8 text") from None
        raise


def _list_array(arrays: list, value_type):
    import pyarrow as pa

    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    values = values.astype(value_type.to_pandas_dtype(), copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))
