"""Prefix caching within one step: the blocks a step fills with known tokens are hashed as they are allocated,
so a sequence admitted later in the same step shares them (n > 1 siblings, a batch with a common few-shot
prefix) instead of prefilling them again. Sound because the step writes every token's KV to the paged cache
before attention reads it. Scheduler-level tests use test_scheduler's fake model (it writes, then reads
back through the block tables); engine-level ones compare a tiny random Llama's greedy tokens and logprobs
with prefix caching on and off, in each mode the feature meets (chunked prefill, preemption, speculative
decoding, an int8 KV cache, multi-step decode), and check what a failed step leaves behind."""
import pytest

from lmjax import LLM, SamplingParams
from lmjax.api.outputs import request_output
from lmjax.engine.block_manager import BlockManager
from lmjax.engine.scheduler import Scheduler
from lmjax.engine.sequence import Sequence, SequenceStatus
from test_scheduler import FakeModel, check_outputs, drive
from tiny_llama import write_tiny_llama

BS = 4
PROMPT = list(range(10, 50))  # 40 tokens: 10 blocks of 4; a sharer computes only the last block's 4
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _scheduler(num_blocks=32, budget=64, max_batch_size=8):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    return bm, Scheduler(bm, max_batch_size, budget)


def _queue(sched, *prompts):
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    return seqs


# ---------------------------------------------------------------- scheduler and block manager

def test_two_fresh_sequences_with_one_prompt_share_its_blocks_in_one_schedule():
    bm, sched = _scheduler()
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    a, b = _queue(sched, prompt, prompt)
    batch = sched.schedule()
    assert [(it.seq, it.start_pos, it.num_new_tokens) for it in batch.items] == [(a, 0, 13), (b, 12, 1)]
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
    assert b.num_prefix_cached_tokens == 12 and a.num_prefix_cached_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (26, 12)
    sched.update(batch, FakeModel(bm).step(batch))  # the fake step writes both, then reads both back


def test_a_running_sequences_later_chunk_is_shared_in_its_step():
    bm, sched = _scheduler(budget=12)
    prompt = list(range(100, 120))  # 5 blocks
    (a,) = _queue(sched, prompt)
    model = FakeModel(bm)
    sched.update(first := sched.schedule(), model.step(first))  # a: tokens 0..11
    b = Sequence(7, prompt)
    sched.add(b)
    model.before_schedule()
    batch = sched.schedule()  # a: tokens 12..19 (blocks 3 and 4 hashed now), then b with the 4 left
    assert [(it.seq, it.start_pos, it.num_new_tokens) for it in batch.items] == [(a, 12, 8), (b, 16, 4)]
    assert b.num_prefix_cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    sched.update(batch, model.step(batch))


def test_blocks_of_a_draft_are_not_hashed_when_allocated():
    bm, sched = _scheduler()
    (a,) = _queue(sched, list(range(100, 107)))  # 7 tokens
    sched.update(batch := sched.schedule(), FakeModel(bm).step(batch))  # + 1 sampled: 8 known tokens
    a.draft_token_ids = [1, 2, 3, 4, 5]  # positions 8..12: the model may reject them
    batch = sched.schedule()
    assert (batch.items[0].start_pos, batch.items[0].num_new_tokens) == (7, 6)
    assert bm.block_hash[a.block_table[1]] is not None  # positions 4..7, all known: hashed as allocated
    assert bm.block_hash[a.block_table[2]] is None and bm.block_hash[a.block_table[3]] is None  # the draft's
    with pytest.raises(ValueError, match="does not know"):
        bm.register_full_blocks(a, a.num_tokens + 1)


def test_siblings_arriving_together_give_the_reference_outputs():
    shared = [9] * 13
    reqs = [(i, shared + [i % 3] * (i % 5), 1 + i % 7, 0) for i in range(12)]  # all arrive in step 0
    seqs, sched, _ = drive(reqs, num_blocks=60, block_size=BS, max_batch_size=12, budget=64, prefix=True)
    check_outputs(reqs, seqs)
    assert all(seqs[i].num_prefix_cached_tokens >= 12 for i in range(1, 12))  # shared in the first step


def test_discarding_a_step_before_it_ran_sends_the_sharer_back_and_forgets_the_hashes():
    bm, sched = _scheduler()
    a, b = _queue(sched, PROMPT, PROMPT)
    batch = sched.schedule()
    written = list(a.block_table)
    sched.discard(batch)  # the step never reached the device
    assert not any(bm.block_hash[x] for x in written) and not set(bm.hash_to_block.values()) & set(written)
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 0 and a.block_table == written
    assert b.status is SequenceStatus.WAITING and list(sched.waiting) == [b] and not b.block_table
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, b.num_prefix_cached_tokens) == (40, 0, 0)
    assert sched.num_preemptions == 0
    batch = sched.schedule()  # a takes its tokens again, b shares them again
    assert [(it.seq, it.start_pos) for it in batch.items] == [(a, 0), (b, 36)]
    sched.update(batch, FakeModel(bm).step(batch))


def test_discarding_a_step_after_advance_recomputes_every_item():
    bm, sched = _scheduler()
    a, b = _queue(sched, PROMPT, PROMPT)
    model = FakeModel(bm)
    sched.update(batch := sched.schedule(), model.step(batch))
    c = Sequence(5, PROMPT + [1])
    sched.add(c)
    batch = sched.schedule()  # a, b decode; c shares 40 tokens
    sched.advance(batch)  # dispatched, then the step raised before its tokens came back
    written = {a.block_table[-1], b.block_table[-1], c.block_table[-1]}
    sched.discard(batch)
    assert not set(bm.hash_to_block.values()) & written
    assert [s.status for s in (a, b, c)] == [SequenceStatus.WAITING] * 3 and list(sched.waiting) == [a, b, c]
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and sched.num_preemptions == 2
    for _ in range(3):
        model.before_schedule()
        sched.update(batch := sched.schedule(), model.step(batch))  # the fake step checks every read


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _generate(path, prompts, params, **kw):
    """(RequestOutputs, engine, prefix-cache hits after the first step) of one engine run."""
    engine = LLM(path, **{"max_model_len": 128, "block_size": BS, "num_scheduler_steps": 1, **kw}).llm_engine
    reqs = [engine.add_request(list(p), params) for p in prompts]
    first_hits = None
    while not all(r.finished for r in reqs):
        engine.step()
        first_hits = engine.blocks.prefix_cache_hits if first_hits is None else first_hits
    return [request_output(r) for r in reqs], engine, first_hits


def _same_outputs(got, want):
    for g, w in zip(got, want, strict=True):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-4)
            for gl, wl in zip(gc.logprobs, wc.logprobs, strict=True):
                assert gl.keys() == wl.keys()
                assert [x.logprob for x in gl.values()] == pytest.approx([x.logprob for x in wl.values()], abs=1e-4)


def _compare(path, prompts, params, **kw):
    want, _, _ = _generate(path, prompts, params, **kw)
    got, engine, first_hits = _generate(path, prompts, params, enable_prefix_caching=True, **kw)
    _same_outputs(got, want)
    return got, engine, first_hits


def _greedy(n=1, max_tokens=8):
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)


SHARED = [PROMPT]  # one prompt, n = 4
FEW_SHOT = [PROMPT[:32] + [60 + i] * (2 + i) for i in range(4)]  # 32 shared tokens, then each its own


def test_n_siblings_share_the_prompt_in_the_first_step(tiny):
    got, engine, first_hits = _compare(tiny, SHARED, _greedy(n=4))
    assert first_hits == engine.blocks.prefix_cache_hits == 3 * 36  # 3 siblings x the 9 blocks they may share
    assert engine.num_prefill_tokens == 40 + 3 * 4
    assert got[0].num_cached_tokens == 36


def test_a_batch_with_a_common_prefix_shares_it_in_the_first_step(tiny):
    got, engine, first_hits = _compare(tiny, FEW_SHOT, _greedy())
    assert first_hits == 3 * 32
    assert [o.num_cached_tokens for o in got] == [0, 32, 32, 32]
    stats = engine.stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_queries"]) == (96, sum(map(len, FEW_SHOT)))


@pytest.mark.parametrize("impl", ["reference", "tiled"])
def test_each_attention_path_off_gpu(tiny, monkeypatch, impl):
    # the jnp reference and the tiled XLA op (the CPU default); on a GPU, "auto" runs the Pallas kernels
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", impl)
    _, _, first_hits = _compare(tiny, FEW_SHOT, _greedy())
    assert first_hits == 3 * 32


def test_chunked_prefill_shares_the_chunk_of_the_step(tiny):
    # 16 tokens a step: the writer's last chunk (tokens 32..39) runs with the first sibling's admission
    got, engine, _ = _compare(tiny, SHARED, _greedy(n=4), max_num_batched_tokens=16)
    # a: 16 + 16 + 8 tokens; with its last 8, two siblings (4 each); the last one next step (4): hashed only
    # after the step, the first sibling would find 32 tokens cached, not 36, and compute 8
    assert engine.num_prefill_tokens == 40 + 3 * 4 and got[0].num_cached_tokens == 36


def test_preemption_under_a_tiny_cache(tiny):
    # 15 usable blocks; 4 siblings of 20 + 24 tokens share 4 blocks and need 7 of their own each
    got, engine, first_hits = _compare(tiny, [PROMPT[:20]], _greedy(n=4, max_tokens=24), num_gpu_blocks_override=16)
    assert engine.scheduler.num_preemptions > 0 and first_hits >= 16


def test_speculative_decoding(tiny):
    prompts = [[5, 9, 32, 30] * 6 + [i] for i in range(3)]  # repetitive: the n-gram lookup drafts
    got, engine, first_hits = _compare(tiny, prompts, _greedy(max_tokens=16), speculative_config=SPEC)
    assert first_hits == 2 * 24 and engine.num_draft_tokens > 0


def test_int8_kv_cache(tiny):
    _, _, first_hits = _compare(tiny, FEW_SHOT, _greedy(), kv_cache_dtype="int8")
    assert first_hits == 3 * 32


def test_multi_step_decode(tiny):
    got, engine, first_hits = _compare(tiny, SHARED, _greedy(n=4, max_tokens=12), num_scheduler_steps=4)
    assert first_hits == 3 * 36 and engine.num_decode_loops > 0


def test_a_step_that_raises_leaves_no_hash_of_its_blocks(tiny):
    want, _, _ = _generate(tiny, SHARED, _greedy(n=4))
    engine = LLM(tiny, max_model_len=128, block_size=BS, num_scheduler_steps=1,
                 enable_prefix_caching=True).llm_engine
    req = engine.add_request(PROMPT, _greedy(n=4))
    read, failed = engine.runner.read_step, []

    def read_once_then_fail(pending):  # the device step was dispatched (and the scheduler advanced)
        if not failed:
            failed.append([list(c.seq.block_table) for c in req.completions])
            raise RuntimeError("device step failed")
        return read(pending)
    engine.runner.read_step = read_once_then_fail
    with pytest.raises(RuntimeError, match="device step failed"):
        engine.step()
    written = {b for table in failed[0] for b in table}
    assert not set(engine.blocks.hash_to_block.values()) & written
    assert not any(engine.blocks.block_hash[b] for b in written)
    assert all(c.seq.num_computed_tokens == 0 for c in req.completions)  # all of them recompute
    while not req.finished:  # a caller that steps on gets the run a working step would have given
        engine.step()
    _same_outputs([request_output(req)], want)


def test_a_long_bf16_prompt_shared_in_its_step(tmp_path):
    # On a GPU: the writer's 600 rows take the Mosaic GPU prefill kernel (>= 512 rows, head_dim and block size
    # multiples of 64, bf16), the sharer's 24 the Triton kernel, reading the 9 blocks written in that step.
    path = write_tiny_llama(tmp_path, hidden_size=256, intermediate_size=256, max_position_embeddings=1024,
                            initializer_range=0.2, eos_token_id=3)
    prompt = [(i * 7) % 240 + 5 for i in range(600)]
    kw = dict(dtype="bfloat16", max_model_len=1024, block_size=64, max_num_batched_tokens=2048)
    want, _, _ = _generate(path, [prompt], _greedy(n=2, max_tokens=4), **kw)
    got, engine, first_hits = _generate(path, [prompt], _greedy(n=2, max_tokens=4), enable_prefix_caching=True, **kw)
    assert first_hits == 576 and engine.num_prefill_tokens == 600 + 24
    for g, w in zip(got[0].outputs, want[0].outputs, strict=True):  # bf16, two kernels: a looser tolerance
        assert g.token_ids == w.token_ids
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=0.1)
