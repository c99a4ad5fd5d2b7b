"""The static shapes of a MoE layer's routed work (portable_fsdp/routed_blocks.py), shared by flax's CPU kernel and
xla's experts: blocks enough for every routing, padding under its bound, room for every pair a token can send."""
import functools
import itertools

import pytest

from portable_fsdp import routed_blocks


@functools.lru_cache(maxsize=None)
def most_blocks(pairs: int, experts: int, rows: int) -> int:
    """The most blocks of `rows` rows any routing of `pairs` pairs to `experts` experts fills (exhaustively)."""
    if experts == 1:
        return -(-pairs // rows)
    return max(-(-mine // rows) + most_blocks(pairs - mine, experts - 1, rows) for mine in range(pairs + 1))


@pytest.mark.parametrize("experts", [1, 2, 3, 5])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_the_block_count_is_the_worst_routing(experts, rows):
    for pairs in range(0, 41):
        worst = most_blocks(pairs, experts, rows)
        assert routed_blocks.block_count(pairs, experts, rows) == max(1, worst), (pairs, experts, rows)


@pytest.mark.parametrize("largest", [None, 128])
@pytest.mark.parametrize("pairs,experts", [(1, 4), (7, 8), (128, 4), (512, 4), (16384 * 8, 128), (2048 * 8, 16),
                                           (10 ** 6, 8)])
def test_block_rows_keep_the_padding_under_its_share(pairs, experts, largest):
    rows = routed_blocks.block_rows(pairs, experts, largest)
    assert rows & (rows - 1) == 0 and 1 <= rows <= (largest or pairs)
    executed = routed_blocks.padded_rows(pairs, experts, largest)
    assert executed == routed_blocks.block_count(pairs, experts, rows) * rows
    assert pairs <= executed <= max(pairs * (1 + 1 / routed_blocks.PADDING_SHARE), pairs + experts - 1)
    if rows != largest:  # the largest such power of two: twice as many rows would pad too much
        assert experts * 2 * rows > pairs / routed_blocks.PADDING_SHARE


@pytest.mark.parametrize("top_k,experts,group", [(2, 4, 2), (2, 8, 4), (3, 6, 2), (1, 4, 4)])
def test_capacity_is_the_most_a_token_can_send_a_group(top_k, experts, group):
    most = max(sum(1 for e in choice if e < group) for choice in itertools.combinations(range(experts), top_k))
    assert routed_blocks.capacity(5, top_k, group) == 5 * most
