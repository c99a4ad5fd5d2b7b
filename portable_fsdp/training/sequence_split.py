"""How a sequence is split over the ranks of a context-parallel group (framework-neutral index math).

Load-balanced ("head-tail"): the sequence is cut into 2·cp chunks and rank r takes chunks r and
2·cp−1−r, so every rank has the same amount of causal attention work. Contiguous: rank r takes the
r-th of cp equal slices. Every backend shards a batch with these indices (and puts gathered shards back with `gathered_order`).
"""
from __future__ import annotations

import numpy as np

from portable_fsdp.errors import UserError


def check_divisible(seq_len: int, cp_size: int, sp_size: int = 1) -> None:
    if sp_size > 1 and seq_len % sp_size:
        raise UserError("data.seq_len", (
            f"{seq_len} must be divisible by plan.sp_size={sp_size} so each rank gets an equal slice; use e.g. "
            f"data.seq_len={seq_len - seq_len % sp_size}"))
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise UserError("data.seq_len", (
            f"{seq_len} must be divisible by 2 x plan.cp_size = {2 * cp_size} (cp_size={cp_size}) so each rank "
            f"gets equal head and tail chunks; use e.g. data.seq_len={seq_len - seq_len % (2 * cp_size)}"))


def shard_indices(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool = True) -> np.ndarray:
    """The global token positions rank `cp_rank` holds, in the order it holds them."""
    if cp_size == 1:
        return np.arange(seq_len)
    if load_balance:
        chunk = seq_len // (2 * cp_size)
        head = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
        tail_chunk = 2 * cp_size - 1 - cp_rank
        tail = np.arange(tail_chunk * chunk, (tail_chunk + 1) * chunk)
        return np.concatenate([head, tail])
    part = seq_len // cp_size
    return np.arange(cp_rank * part, (cp_rank + 1) * part)


def gathered_order(seq_len: int, cp_size: int, load_balance: bool = True) -> np.ndarray:
    """Global positions of the concatenation of every rank's shard, rank 0 first."""
    return np.concatenate([shard_indices(seq_len, cp_size, r, load_balance) for r in range(cp_size)])
