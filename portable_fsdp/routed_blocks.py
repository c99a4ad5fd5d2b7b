"""The static shapes of a MoE layer's routed work, for the lowerings that compile one program whatever the routing
(flax's CPU kernel, xla): the (token, expert) pairs are placed by expert into blocks of `block_rows` rows, one
expert's pairs per block (its last block padded with empty rows), and each block runs through its expert's weights.

Every count is bounded before any routing is known, so the shapes are those of the bounds:
- an expert with c pairs fills ceil(c / rows) blocks, so E experts' p pairs fill at most (p + E·(rows − 1)) / rows
  (`block_count`): the empty rows stay under E·rows, which `block_rows` keeps under 1/PADDING_SHARE of the pairs;
- a token chooses each expert at most once, so it sends a set of E experts at most min(top_k, E) pairs
  (`capacity`): what a device or a group of experts must make room for when it receives the pairs of other tokens.
"""
from __future__ import annotations

PADDING_SHARE = 4  # empty rows stay under 1 / PADDING_SHARE of the pairs


def block_rows(pairs: int, experts: int, largest: int | None = None) -> int:
    """The rows of a block for `pairs` pairs among `experts` experts: the largest power of two (at most `largest`)
    whose padding, at most rows − 1 empty rows per expert, stays under a PADDING_SHARE-th of the pairs."""
    fitting = max(1, pairs // (PADDING_SHARE * experts))
    rows = 1 << (fitting.bit_length() - 1)
    return rows if largest is None else min(largest, rows)


def block_count(pairs: int, experts: int, rows: int) -> int:
    """Blocks of `rows` rows enough for any routing of `pairs` pairs among `experts` experts (of which at most
    `pairs` hold any)."""
    return max(1, (pairs + min(experts, pairs) * (rows - 1)) // rows)


def padded_rows(pairs: int, experts: int, largest: int | None = None) -> int:
    """The rows the blocks for any routing of `pairs` pairs among `experts` experts take: what the matmuls run on."""
    rows = block_rows(pairs, experts, largest)
    return block_count(pairs, experts, rows) * rows


def capacity(tokens: int, top_k: int, experts: int) -> int:
    """The most pairs `tokens` tokens with `top_k` experts each route to a set of `experts` experts."""
    return tokens * min(top_k, experts)
