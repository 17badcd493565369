"""Iteration-level scheduling: which sequences run in the next step, and how many new tokens each.

Every step, running sequences go first, oldest first: a decoding one needs 1 token, a prefilling one
the rest of its prompt, chunked to what is left of the token budget. When the KV pool cannot hold a
running sequence's new tokens, the newest running sequences are preempted (their blocks freed, to be
recomputed later) until it fits. Then, if nothing was preempted, waiting sequences are admitted in
order while the budget, the sequence limit and the free blocks (minus a watermark) allow.

The oldest running sequence can always proceed (the engine refuses requests that cannot fit alone),
so the loop never stalls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.config import EngineConfig
from posttrain.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes K/V for its next num_new_tokens[i] tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_reserved_seats(self) -> int:
        """Running sequences plus the forks they will make when their prefill ends."""
        return sum(1 + seq.num_forks for seq in self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: everything after it is gone too
            self._schedule(seq, num_new, batch)
            budget -= num_new
            i += 1

        if not batch.preempted:
            seats = self.num_reserved_seats
            # The watermark only keeps room for running sequences; with none, it would only block the queue.
            reserve = self.config.reserve_blocks(bm.num_blocks) if self.running else 0
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if seats + 1 + seq.num_forks > self.config.max_num_seqs:
                    break
                cached = bm.find_cached_prefix(seq)
                num_new = min(seq.num_tokens - len(cached) * bm.block_size, budget)
                if bm.num_blocks_to_admit(seq, cached, num_new) + reserve > bm.num_free_blocks:
                    break
                self.waiting.popleft()
                bm.allocate_prefix(seq, cached)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seats += 1 + seq.num_forks
                self._schedule(seq, num_new, batch)
                budget -= num_new
        batch.blocks_to_copy = bm.take_pending_copies()
        return batch

    def _schedule(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        self.block_manager.allocate(seq, num_new)
        self.block_manager.publish(seq, seq.num_cached_tokens + num_new)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first in line; it recomputes its K/V when readmitted."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached_tokens = 0
        seq.stale_kv = False  # it recomputes its K/V under the current weights when readmitted
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Send every running sequence back to recompute (after a weight update)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def mark_running_stale(self) -> None:
        """Let every running sequence go on over K/V computed under the old weights (after a weight update)."""
        for seq in self.running:
            seq.stale_kv = True

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children of a parent that just finished its prefill run right after it from now on."""
        at = self.running.index(parent) + 1
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = children

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
