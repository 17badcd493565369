"""The block manager: which KV blocks each sequence holds, reference counts, and the prefix cache.

Plain-Python bookkeeping; the runner turns block tables into tensors and performs the copies that
copy-on-write asks for (`take_pending_copies`).

Prefix cache: a full block is registered under a hash of its token ids chained with the hash of the
block before it, once its K/V is computed (or is being computed in the step that schedules it: a layer
writes all new K/V before any attention reads it). A block whose last reference goes away stays
findable by its hash until it is evicted to serve an allocation, least recently freed first, after
blocks that hold nothing cached.
"""

from __future__ import annotations

from collections import OrderedDict

from posttrain.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while the block is registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()  # the tokens it holds, checked on a hash hit


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Content hash of a full block, chained with the hash of the prefix before it."""
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Free blocks: those holding nothing cached are used first; then cached ones, least recently freed first.
        self.free_uncached: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for copy-on-write
        self.num_cache_hit_tokens = 0  # statistics: prompt tokens served from the prefix cache
        self.num_queried_tokens = 0

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `allocate(seq, num_new_tokens)` would take from the free pool (copy-on-write included)."""
        end = seq.num_cached_tokens + num_new_tokens
        needed = max(0, self.blocks_for_tokens(end) - len(seq.block_table))
        return needed + int(self._needs_copy_on_write(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def num_blocks_to_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> int:
        """Free-pool blocks that admitting seq takes: cached blocks nobody holds, plus new blocks."""
        revived = sum(1 for block_id in cached if self.blocks[block_id].ref_count == 0)
        end = len(cached) * self.block_size + num_new_tokens
        return revived + self.blocks_for_tokens(end) - len(cached)

    # ---- prefix cache -----------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks within its `num_reusable_tokens` (never the
        block of its last token, whose logits give the next token). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(seq.num_reusable_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else hash_block(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
            parent = h
        return found

    def allocate_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give a sequence with no blocks the cached blocks `find_cached_prefix` returned."""
        assert not seq.block_table and seq.num_cached_tokens == 0, seq
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached_tokens = seq.num_cache_hit_tokens = len(block_ids) * self.block_size
        self._extend_hashes(seq, seq.num_cached_tokens)
        self.num_cache_hit_tokens += seq.num_cached_tokens
        self.num_queried_tokens += seq.num_tokens

    def publish(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the blocks that become full when seq's first `num_computed_tokens` tokens are computed
        (call before seq.num_cached_tokens moves up to it)."""
        self._extend_hashes(seq, num_computed_tokens)
        if not self.enable_prefix_caching or seq.stale_kv:
            return  # stale_kv: part of its K/V came from older weights; nobody else may be served it
        for i in range(seq.num_cached_tokens // self.block_size, num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue  # registered already (by us, or it came from the cache)
            h = seq.block_hashes[i]
            if h in self.hash_to_block:
                continue  # another block holds the same content; keep that one
            block.hash = h
            block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.hash_to_block[h] = block.block_id

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their K/V was computed under weights that have changed)."""
        for block_id in self.hash_to_block.values():
            self.blocks[block_id].hash = None
            self.blocks[block_id].token_ids = ()
        self.hash_to_block.clear()
        self.free_uncached.update(self.free_cached)
        self.free_cached.clear()

    # ---- allocate, fork, free -----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for K/V of tokens [num_cached_tokens, num_cached_tokens + num_new_tokens).

        If the first of them falls in a block shared with another sequence, that block is copied first
        (copy-on-write); only the partial last block of a forked prompt is ever shared and written.
        """
        if self.num_new_blocks(seq, num_new_tokens) > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks for {seq}")  # the scheduler checks can_allocate first
        if self._needs_copy_on_write(seq):
            index = seq.num_cached_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1  # still >= 1: another sequence holds it
            seq.block_table[index] = dst
            self.pending_copies.append((src, dst))
        end = seq.num_cached_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_for_tokens(end):
            seq.block_table.append(self._take_free_block())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        self._release(seq.block_table)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first `num_tokens` tokens (speculative decoding: the blocks that
        held only rejected draft positions)."""
        keep = self.blocks_for_tokens(num_tokens)
        if len(seq.block_table) > keep:
            self._release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # the tail is the least reusable: evict it first
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_uncached[block_id] = None

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        index = seq.num_cached_tokens // self.block_size
        return index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id, _ = self.free_uncached.popitem(last=False)
        else:
            block_id, _ = self.free_cached.popitem(last=False)  # evict the least recently freed cached block
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id
