"""Scheduler driven by a fake model that reads its context back through the paged cache.

The fake step writes (position, token) into the slot of every new token, the way the device step
writes KV, and for each sampling item reads the whole context back through the block table. The next
token is a function of that context, so any bookkeeping slip (wrong slot, a shared block overwritten,
a prefix-cache hit with the wrong content, a lost token on preemption) changes the outputs or trips an
assertion. Reference outputs come from running each request alone on plain lists.
"""
import random

import pytest

from lmjax.engine.block_manager import BlockManager
from lmjax.engine.scheduler import Scheduler
from lmjax.engine.sequence import Sequence, SequenceStatus


def next_token(context):
    return (sum(context) * 7 + context[-1] + 1) % 100


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeModel:
    """The device step, on a Python list standing in for the paged KV cache."""

    def __init__(self, bm):
        self.bm = bm
        self.cache = [None] * (bm.num_blocks * bm.block_size)
        self.frozen, self.fresh = set(), set()
        allocate = bm._allocate

        def allocate_and_note():
            self.fresh.add(block := allocate())
            return block
        bm._allocate = allocate_and_note

    def before_schedule(self):
        """Blocks held and hashed now are immutable in the coming step unless freed and handed out again (a
        block hashed while scheduling it is written in that step: prefix caching hashes blocks as they are
        allocated for known tokens)."""
        bm = self.bm
        self.frozen = {b for b in range(bm.num_blocks) if bm.block_hash[b] is not None and bm.ref_counts[b] > 0}
        self.fresh = set()

    def step(self, batch):
        bm, sampled, writer = self.bm, {}, {}
        for item in batch.items:
            seq = item.seq
            assert 0 not in seq.block_table
            for pos in range(item.start_pos, item.start_pos + item.num_new_tokens):
                block = seq.block_table[pos // bm.block_size]
                # shared only once hashed (for a block hashed as allocated: from the step that writes it)
                assert bm.ref_counts[block] == 1 or bm.block_hash[block] is not None, "write into a shared block"
                assert writer.setdefault(block, seq) is seq, "two sequences write into one block"
                assert block not in self.frozen - self.fresh, "write into a registered (immutable) block"
                self.cache[bm.slot(seq, pos)] = (pos, seq.token_slice(pos, pos + 1)[0])
        for item in batch.items:  # attention reads after all writes, like one fused step
            if item.samples:
                seq = item.seq
                ctx = [self.cache[bm.slot(seq, p)] for p in range(seq.num_tokens)]
                assert ctx == list(enumerate(seq.token_ids)), "cache content differs from tokens"
                sampled[seq.seq_id] = next_token([t for _, t in ctx])
        return sampled


def make_requests(n, seed, shared_prefix=()):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = list(shared_prefix) + [rng.randrange(100) for _ in range(rng.randint(1, 30))]
        reqs.append((i, prompt, rng.randint(1, 16), rng.randrange(0, 3 * n)))  # id, prompt, max, arrival step
    return reqs


def drive(reqs, num_blocks=24, block_size=4, max_batch_size=6, budget=16, prefix=False):
    """Engine loop: requests arrive over time; returns outputs, scheduler and per-step stats."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_batch_size, budget)
    model = FakeModel(bm)
    pending = sorted(reqs, key=lambda r: r[3])
    limits, seqs, stats = {}, {}, {"steps": 0, "max_tokens": 0, "max_items": 0, "joined_mid_run": 0, "chunks": 0}
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][3] <= step:
            i, prompt, max_tokens, _ = pending.pop(0)
            seqs[i], limits[i] = Sequence(seq_id=i, prompt_token_ids=prompt), max_tokens
            stats["joined_mid_run"] += sched.num_running > 0
            sched.add(seqs[i])
        was_running = set(map(id, sched.running))
        model.before_schedule()
        batch = sched.schedule()
        if batch.preempted:  # no admission in a step that had to preempt
            assert all(id(it.seq) in was_running for it in batch.items)
        assert batch.num_tokens == sum(it.num_new_tokens for it in batch.items) <= budget
        assert len(batch.items) <= max_batch_size and sched.num_running <= max_batch_size
        assert not batch.failed
        arrivals = [s.arrival for s in sched.running]
        assert arrivals == sorted(arrivals), "running must stay in arrival order"
        sched.update(batch, model.step(batch))
        for item in batch.items:
            if item.samples and len(item.seq.output_token_ids) >= limits[item.seq.seq_id]:
                sched.finish(item.seq, "length")
        stats["max_tokens"] = max(stats["max_tokens"], batch.num_tokens)
        stats["max_items"] = max(stats["max_items"], len(batch.items))
        stats["chunks"] += sum(not it.samples for it in batch.items)
        step += 1
        assert step < 10_000, "scheduler made no progress"
    stats["steps"] = step
    return seqs, sched, stats


def check_outputs(reqs, seqs):
    for i, prompt, max_tokens, _ in reqs:
        assert seqs[i].status is SequenceStatus.FINISHED and seqs[i].finish_reason == "length"
        assert seqs[i].output_token_ids == reference(prompt, max_tokens), f"request {i}"


def test_tiny_cache_forces_preemption_and_outputs_match_running_alone():
    reqs = make_requests(40, seed=0)
    seqs, sched, stats = drive(reqs, num_blocks=16, block_size=4, max_batch_size=6, budget=16)
    check_outputs(reqs, seqs)
    assert sched.num_preemptions > 0 and any(s.num_preemptions for s in seqs.values())
    assert sched.bm.num_free_blocks == 15 and all(r == 0 for r in sched.bm.ref_counts)
    assert stats["max_tokens"] == 16 and stats["joined_mid_run"] > 0 and stats["chunks"] > 0


def test_large_cache_never_preempts_and_chunks_long_prompts():
    reqs = make_requests(30, seed=1)
    reqs.append((99, list(range(60)), 3, 0))  # 60-token prompt, budget 8 -> several chunks
    seqs, sched, stats = drive(reqs, num_blocks=200, block_size=4, max_batch_size=6, budget=8)
    check_outputs(reqs, seqs)
    assert sched.num_preemptions == 0 and stats["max_items"] == 6 and stats["chunks"] >= 7
    assert sched.bm.num_free_blocks == 199


def test_prefix_caching_gives_identical_outputs_and_hits():
    system = [42] * 13
    reqs = make_requests(30, seed=2, shared_prefix=system)
    plain, _, _ = drive(reqs, num_blocks=40, prefix=False)
    cached, sched, _ = drive(reqs, num_blocks=40, prefix=True)
    check_outputs(reqs, plain)
    check_outputs(reqs, cached)
    bm = sched.bm
    assert bm.prefix_cache_hits >= 12 * 10 and 0 < bm.hit_rate < 1
    assert any(s.num_prefix_cached_tokens >= 12 for s in cached.values())
    assert bm.num_free_blocks == 39 and all(r == 0 for r in bm.ref_counts)


def test_prefix_caching_with_preemption_under_a_tiny_cache():
    reqs = make_requests(40, seed=3, shared_prefix=[7] * 9)
    seqs, sched, _ = drive(reqs, num_blocks=20, block_size=4, max_batch_size=8, budget=12, prefix=True)
    check_outputs(reqs, seqs)
    assert sched.num_preemptions > 0 and sched.bm.prefix_cache_hits > 0
    assert sched.bm.num_free_blocks == 19


@pytest.mark.parametrize("block_size,budget,batch", [(1, 1, 1), (2, 3, 2), (16, 64, 32)])
def test_odd_shapes(block_size, budget, batch):
    reqs = make_requests(12, seed=block_size)
    num_blocks = 1 + -(-46 // block_size)  # just fits the longest request (30 + 16 tokens)
    seqs, sched, stats = drive(reqs, num_blocks, block_size, batch, budget, prefix=True)
    check_outputs(reqs, seqs)
    assert stats["max_tokens"] <= budget and sched.bm.num_free_blocks == num_blocks - 1


def test_items_report_start_pos_and_sampling():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_batch_size=4, max_prefill_token_num=10)
    a, b = Sequence(1, list(range(7))), Sequence(2, list(range(12)))
    sched.add(a), sched.add(b)
    items = sched.schedule().items
    assert [(it.seq, it.num_new_tokens, it.start_pos, it.samples) for it in items] == [
        (a, 7, 0, True), (b, 3, 0, False)]


def test_chunked_prefill_then_decode_positions():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_batch_size=4, max_prefill_token_num=5)
    s = Sequence(1, list(range(12)))
    sched.add(s)
    seen = []
    for _ in range(4):
        batch = sched.schedule()
        it = batch.items[0]
        seen.append((it.start_pos, it.num_new_tokens, it.samples))
        sched.update(batch, {1: 0} if it.samples else {})
    assert seen == [(0, 5, False), (5, 5, False), (10, 2, True), (12, 1, True)]
    assert s.num_computed_tokens == 13 and s.num_tokens == 14


def test_sequence_larger_than_the_cache_fails_without_blocking_others():
    bm = BlockManager(5, 4)  # 16 slots
    sched = Scheduler(bm, max_batch_size=4, max_prefill_token_num=64)
    big, small = Sequence(1, list(range(17))), Sequence(2, [1, 2, 3])
    assert not sched.fits_in_cache(17) and sched.fits_in_cache(16)
    sched.add(big), sched.add(small)
    batch = sched.schedule()
    assert batch.failed == [big] and big.finish_reason == "error" and big.block_table == []
    assert [it.seq for it in batch.items] == [small]


def test_decode_growing_past_the_cache_ends_in_error_not_a_loop():
    bm = BlockManager(3, 4)  # 8 slots
    sched = Scheduler(bm, max_batch_size=2, max_prefill_token_num=16)
    s = Sequence(1, list(range(6)))
    sched.add(s)
    for step in range(20):
        batch = sched.schedule()
        if batch.failed:
            break
        sched.update(batch, {it.seq.seq_id: 0 for it in batch.items if it.samples})
    assert batch.failed == [s] and s.num_tokens == 9 and s.num_preemptions == 1
    assert not sched.has_unfinished() and bm.num_free_blocks == 2


def test_abort_in_every_state_frees_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_size=1, max_prefill_token_num=64)
    a, b = Sequence(1, list(range(9))), Sequence(2, list(range(5)))
    sched.add(a), sched.add(b)
    batch = sched.schedule()
    assert sched.num_running == 1 and sched.num_waiting == 1  # max_batch_size=1
    assert sched.abort(2) is b and b.finish_reason == "abort" and sched.num_waiting == 0
    sched.abort(1)  # aborted between schedule and update: update must skip it
    sched.update(batch, {1: 5})
    assert a.output_token_ids == [] and a.status is SequenceStatus.FINISHED
    assert bm.num_free_blocks == 7 and not sched.has_unfinished()
    assert sched.abort(1) is None and sched.abort(12345) is None


def test_admission_waits_while_preempting_and_keeps_order():
    bm = BlockManager(6, 2)  # 5 usable blocks of 2 slots
    sched = Scheduler(bm, max_batch_size=4, max_prefill_token_num=64)
    seqs = [Sequence(i, [i] * 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [it.seq.seq_id for it in batch.items] == [0, 1]  # the 3rd would eat the watermark block
    assert bm.num_free_blocks == 1 and list(sched.waiting) == [seqs[2]]
    sched.update(batch, {0: 1, 1: 1})
    batch = sched.schedule()  # position 3 is still in block 1: plain decode
    assert not batch.preempted and len(batch.items) == 2
    sched.update(batch, {0: 1, 1: 1})
    batch = sched.schedule()  # position 4 needs a 3rd block each, only 1 is free: the newest yields
    assert batch.preempted == [seqs[1]] and [it.seq for it in batch.items] == [seqs[0]]
    assert list(sched.waiting) == [seqs[1], seqs[2]] and seqs[1].num_computed_tokens == 0


def step_until_preemption(sched, max_steps=50):
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch.preempted:
            return batch
        sched.update(batch, {it.seq.seq_id: 0 for it in batch.items if it.samples})
    raise AssertionError("no preemption happened")


def test_the_newest_yields_to_the_oldest_and_is_not_readmitted_in_the_same_step():
    bm = BlockManager(6, 4)  # 5 usable blocks
    sched = Scheduler(bm, max_batch_size=4, max_prefill_token_num=8)
    old, new = Sequence(1, [1]), Sequence(2, list(range(11)))
    sched.add(old), sched.add(new)
    batch = step_until_preemption(sched)
    assert len(old.block_table) == 2 and old.num_computed_tokens == 4  # old took a fresh block...
    assert batch.preempted == [new] and [it.seq for it in batch.items] == [old]  # ...the new one paid
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_preemptions == 1
    assert bm.num_free_blocks >= bm.blocks_for(8) + sched.watermark_blocks  # a chunk would fit
    sched.update(batch, {old.seq_id: 0})
    batch = sched.schedule()  # ...and is readmitted in the next step, before anything else
    assert [it.seq for it in batch.items] == [old, new]
