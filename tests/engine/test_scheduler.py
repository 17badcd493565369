"""Scheduler: admission, chunked prefill, limits, preemption; pure bookkeeping, no model."""

from __future__ import annotations

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.config import EngineConfig
from posttrain.engine.sampling_params import SamplingParams
from posttrain.engine.scheduler import Scheduler
from posttrain.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 32, block_size: int = 4, **fields) -> Scheduler:
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 64, **fields}
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, watermark=0.0, **fields)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def seq_of(n_tokens: int, request_id: str = "r", num_forks: int = 0, start: int = 0) -> Sequence:
    return Sequence(request_id, list(range(start, start + n_tokens)), SamplingParams(), None, num_forks=num_forks)


def finish_step(sched: Scheduler, batch, new_token: int = 7) -> None:
    """The engine's part: mark K/V computed, append a token to sequences that reached their end."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_cached_tokens += n
        if seq.num_cached_tokens == seq.num_tokens:
            seq.token_ids.append(new_token)


def test_admission_respects_max_num_seqs_and_order() -> None:
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [seq_of(5, f"r{i}", start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and batch.num_new_tokens == [5, 5]
    assert sched.waiting[0] is seqs[2] and seqs[2].status is SequenceStatus.WAITING
    finish_step(sched, batch)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1]  # decodes; the third still waits for a seat
    sched.finish(seqs[0], "stop")
    finish_step(sched, batch)
    batch = sched.schedule()
    assert batch.seqs == [seqs[1], seqs[2]] and batch.num_new_tokens == [1, 5]


def test_forks_reserve_seats() -> None:
    sched = make(max_num_seqs=4, max_num_batched_tokens=64)
    parent = seq_of(5, "a", num_forks=3)  # n=4: takes all four seats
    other = seq_of(5, "b", start=50)
    sched.add(parent)
    sched.add(other)
    batch = sched.schedule()
    assert batch.seqs == [parent]


def test_chunked_prefill_and_token_budget() -> None:
    sched = make(max_num_batched_tokens=8, max_num_seqs=4)
    long, short = seq_of(20, "long"), seq_of(3, "short", start=100)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert batch.seqs == [long] and batch.num_new_tokens == [8]
    finish_step(sched, batch)
    batch = sched.schedule()
    assert batch.num_new_tokens == [8]
    finish_step(sched, batch)
    batch = sched.schedule()
    assert batch.seqs == [long, short] and batch.num_new_tokens == [4, 3]
    finish_step(sched, batch)
    assert long.num_output_tokens == 1 and short.num_output_tokens == 1
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1] and batch.num_batched_tokens == 2


def test_preemption_frees_newest_and_requeues_it_first() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = seq_of(7, "a"), seq_of(7, "b", start=100)  # two blocks each: the pool is full
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b]
    finish_step(sched, batch)  # both now have 8 tokens
    finish_step_tokens = [a.num_tokens, b.num_tokens]
    assert finish_step_tokens == [8, 8]
    batch = sched.schedule()  # decoding position 7 fits the second block of each: no new block yet
    assert batch.seqs == [a, b]
    finish_step(sched, batch)
    batch = sched.schedule()  # position 8 needs a third block for each: b is preempted for a
    assert batch.seqs == [a] and batch.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_cached_tokens == 0
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    sched.finish(a, "stop")
    batch = sched.schedule()
    # b recomputes prompt + output so far (9 tokens), less its first block: still in the prefix cache
    # (a's new block evicted b's freed tail block, the least reusable, first).
    assert batch.seqs == [b] and b.num_cache_hit_tokens == 4 and batch.num_new_tokens == [5]
    assert sched.block_manager.num_free_blocks == 4 - 3


def test_preempting_itself_when_it_is_the_newest() -> None:
    sched = make(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a, b = seq_of(4, "a"), seq_of(4, "b", start=100)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())  # each has 1 block holding 4 tokens, plus a 5th token now
    batch = sched.schedule()  # a takes the last free block; b needs one too: b preempts itself
    assert batch.seqs == [a] and batch.preempted == [b]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = seq_of(8, "a"), seq_of(7, "b", start=100)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())
    c = seq_of(1, "c", start=200)
    sched.add(c)
    batch = sched.schedule()  # a needs a block: b preempted; c must not slip in
    assert c not in batch.seqs and b in batch.preempted


def test_watermark_holds_back_admission() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=10, watermark=0.5, max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(10, 4))
    small, big = seq_of(3, "small"), seq_of(16, "big", start=50)  # 1 block, then 4 more would leave 5 free
    sched.add(small)
    sched.add(big)
    batch = sched.schedule()
    assert batch.seqs == [small, big]
    finish_step(sched, batch)
    sched.finish(big, "abort")
    bigger = seq_of(20, "bigger", start=100)  # 5 blocks would leave 4 < 5 free: waits while small runs
    sched.add(bigger)
    finish_step(sched, sched.schedule())
    assert bigger not in sched.schedule().seqs
    sched.finish(small, "stop")
    assert sched.schedule().seqs == [bigger]  # with nothing running the watermark does not apply


def test_finish_and_abort_free_blocks() -> None:
    sched = make()
    a = seq_of(9)
    sched.add(a)
    sched.schedule()
    assert sched.block_manager.num_free_blocks == 32 - 3
    sched.finish(a, "abort")
    assert sched.block_manager.num_free_blocks == 32 and not sched.has_unfinished()
    w = seq_of(3, "w")
    sched.add(w)
    sched.finish(w, "abort")  # a waiting sequence holds nothing but leaves the queue
    assert not sched.waiting


def test_shared_system_prompt_is_computed_once_per_step() -> None:
    """Two new requests with the same first block: the second finds the block the first computes in
    this very step (published at scheduling time) and skips it."""
    sched = make(max_num_batched_tokens=64)
    a = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(), None)
    b = Sequence("b", [1, 2, 3, 4, 9, 9, 9], SamplingParams(), None)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [6, 3] and b.num_cache_hit_tokens == 4
    assert a.block_table[0] == b.block_table[0]


def test_preempt_all_and_forks_run_after_parent() -> None:
    sched = make(max_num_batched_tokens=64)
    parent, other = seq_of(6, "p", num_forks=2), seq_of(5, "o", start=100)
    sched.add(parent)
    sched.add(other)
    finish_step(sched, sched.schedule())
    parent.token_ids.pop()  # the engine forks before appending the sampled tokens
    children = [parent.fork(i, None) for i in (1, 2)]
    parent.num_forks = 0
    sched.add_forks(parent, children)
    assert sched.running == [parent, *children, other]
    sched.preempt_all()
    assert not sched.running and list(sched.waiting) == [parent, *children, other]
    assert sched.block_manager.num_free_blocks == 32
