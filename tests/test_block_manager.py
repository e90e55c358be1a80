"""The block manager alone: exact counts through allocation, sharing, copy-on-write and freeing."""

import pytest

from bento_pagedllm.block_manager import BlockManager
from bento_pagedllm.sampling_params import SamplingParams
from bento_pagedllm.sequence import Request


def make_seq(num_tokens: int, n: int = 1):
    return Request("r", None, list(range(num_tokens)), SamplingParams(n=n), rng_seed=0).seqs[0]


def test_allocate_covers_positions_and_free_returns_everything():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(10)
    assert bm.allocate_slots(seq, 6) == []
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 8
    seq.num_computed_tokens = 6
    assert bm.allocate_slots(seq, 4) == []  # positions 6..9 -> 3 blocks in all
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    assert len(set(seq.block_table)) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    assert all(count == 0 for count in bm.ref_counts)


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(12)
    assert bm.allocate_slots(seq, 12) is None
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_blocks_and_copy_on_write_of_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(6, n=2)
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, rng_seed=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.num_free_blocks == 6
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    # the child writes position 6 into the shared, partially filled second block: it gets a copy
    child._token_ids.append(99)
    copies = bm.allocate_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    assert bm.ref_counts[parent.block_table[1]] == 1
    # the parent is now the only owner of its block: it writes in place
    parent._token_ids.append(7)
    assert bm.allocate_slots(parent, 1) == []
    bm.free(child)
    bm.free(parent)
    assert bm.num_free_blocks == 8


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = make_seq(6, n=2)
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, rng_seed=1)
    bm.fork(parent, child)
    assert bm.allocate_slots(child, 1) is None
    assert bm.ref_counts[parent.block_table[1]] == 2


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(3)
    bm.allocate_slots(seq, 3)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError):
        bm.free(seq)
