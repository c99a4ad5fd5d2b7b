"""How the training and eval loss is cut into chunks of tokens (train.loss_chunk_tokens), the same on every
backend: each chunk spans every row and every sequence part of the micro-batch and a run of positions, so under
SPMD — rows split over the data-parallel devices, positions over cp|sp — every device holds its share of every
chunk and computes `chunk_tokens` tokens' logits at a time.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chunking:
    """`tokens`: tokens per device per chunk (0: unchunked). `sequence_parts`: devices one sequence is split over
    in a global (SPMD) program, else 1; `row_shards`: devices the rows are split over there, else 1."""

    tokens: int
    sequence_parts: int = 1
    row_shards: int = 1

    def positions(self, rows: int, positions: int) -> int:
        """Positions of each sequence part in one chunk, for a micro-batch of `rows` rows and `positions`
        positions per sequence part: `tokens` per device, at least one, at most all."""
        local_rows = max(1, rows // self.row_shards)
        return max(1, min(positions, self.tokens // local_rows)) if self.tokens > 0 else positions

    def count(self, rows: int, positions: int) -> int:
        """Chunks of a micro-batch (the last one shorter when the chunk does not divide the positions)."""
        return -(-positions // self.positions(rows, positions))
