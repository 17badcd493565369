"""BlockManager: allocation, reference counts, prefix-cache hits by content hash, copy-on-write."""

from __future__ import annotations

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.sampling_params import SamplingParams
from posttrain.engine.sequence import Sequence


def seq_of(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), None)


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What the scheduler + engine do for one step of seq: allocate, publish, mark computed."""
    bm.allocate(seq, num_new)
    bm.publish(seq, seq.num_cached_tokens + num_new)
    seq.num_cached_tokens += num_new


def test_allocate_and_free_counts() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = seq_of(list(range(10)))
    assert bm.num_new_blocks(seq, 10) == 3
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    seq.token_ids.append(10)
    compute(bm, seq, 1)  # position 10 still fits the third block
    assert len(seq.block_table) == 3
    seq.token_ids += [11, 12]
    compute(bm, seq, 2)  # positions 11, 12: a fourth block
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []


def test_chunked_allocation_grows_block_by_block() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = seq_of(list(range(13)))
    compute(bm, seq, 5)
    assert len(seq.block_table) == 2
    compute(bm, seq, 8)
    assert len(seq.block_table) == 4 and seq.num_cached_tokens == 13


def test_prefix_cache_hit_shares_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq_of(list(range(10)), "a")
    compute(bm, a, 10)  # blocks: [0-3] [4-7] full, [8-9] partial
    b = seq_of(list(range(9)) + [99], "b")
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]  # the partial block is never shared through the cache
    bm.allocate_prefix(b, cached)
    assert b.num_cached_tokens == 8
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    compute(bm, b, 2)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]


def test_hash_chains_the_prefix() -> None:
    """The same block content after a different prefix is a different block."""
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a, 9)
    b = seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(b) == []


def test_last_token_block_is_never_taken_from_cache() -> None:
    """A prompt that is all cached still computes its last token (its logits give the next token)."""
    bm = BlockManager(num_blocks=20, block_size=4)
    a = seq_of(list(range(8)))
    compute(bm, a, 8)
    b = seq_of(list(range(8)))
    assert bm.find_cached_prefix(b) == a.block_table[:1]


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(list(range(9)))
    compute(bm, a, 9)  # 3 blocks, two of them full and cached
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    b = seq_of(list(range(9)))
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.num_blocks_to_admit(b, cached, 1) == 3  # two revived from the free pool + one new
    bm.allocate_prefix(b, cached)
    assert bm.num_free_blocks == 2
    bm.free(b)
    # Allocating fresh blocks uses uncached blocks first, then evicts cached ones.
    c = seq_of(list(range(100, 113)))
    compute(bm, c, 13)
    assert len(bm.hash_to_block) <= 1 + 3  # evicted entries are gone from the map
    assert all(bm.blocks[x].ref_count == 1 for x in c.block_table)
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_fork_shares_blocks_and_copy_on_write_on_partial_block() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    parent = seq_of(list(range(6)))  # one full block + a partial one
    compute(bm, parent, 6)
    children = [parent.fork(i, None) for i in (1, 2)]
    for child in children:
        bm.fork(parent, child)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3]
    free_before = bm.num_free_blocks
    for i, s in enumerate([parent, *children]):
        s.token_ids.append(50 + i)
    # The first two writers copy the shared partial block; the last one owns it and writes in place.
    assert bm.num_new_blocks(parent, 1) == 1
    bm.allocate(parent, 1)
    assert bm.take_pending_copies() == [(children[0].block_table[1], parent.block_table[1])]
    bm.allocate(children[0], 1)
    assert len(bm.take_pending_copies()) == 1
    assert bm.num_new_blocks(children[1], 1) == 0
    bm.allocate(children[1], 1)
    assert bm.take_pending_copies() == []
    assert bm.num_free_blocks == free_before - 2
    assert bm.blocks[parent.block_table[0]].ref_count == 3  # the full block stays shared
    assert len({s.block_table[1] for s in [parent, *children]}) == 3
    for s in [parent, *children]:
        bm.free(s)
    assert bm.num_free_blocks == 20


def test_reset_prefix_cache_forgets_everything() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(list(range(9)))
    compute(bm, a, 9)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(seq_of(list(range(9)))) == []
    bm.free(a)
    assert bm.num_free_blocks == 10 and not bm.free_cached


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = seq_of(list(range(9)))
    compute(bm, a, 9)
    assert bm.find_cached_prefix(seq_of(list(range(9)))) == [] and not bm.hash_to_block
