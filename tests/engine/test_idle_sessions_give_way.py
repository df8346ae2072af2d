"""Idle sessions (a turn with sequence_end=False whose client never came back: the long-lived server's usual
case) keep their KV blocks; when the cache runs short, LMDeploy's scheduler evicts those idle ("hanging",
MessageStatus.STOPPED) sequences first, both to admit a waiting request (`_schedule_prefill`'s
__evict_for_seq: evictable = hanging + waiting) and to let a running one grow (`_schedule_decoding`: the
same, before it preempts a running sequence). lmjax evicted idle sessions only when a step scheduled nothing
at all (LLMEngine.step -> SessionsMixin._evict_idle_session): meanwhile running requests were preempted and
recomputed, and waiting ones waited behind the running ones, while abandoned sessions held the cache (probe 26)."""
import pytest

from lmjax import LLM, SamplingParams
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    # 19 usable blocks of 8 tokens
    return LLM(path, max_model_len=128, block_size=8, max_num_seqs=8, num_gpu_blocks_override=20,
               num_scheduler_steps=1).llm_engine


def _run(engine, reqs):
    most = 0
    while not all(r.finished for r in reqs):
        engine.step()
        most = max(most, engine.scheduler.num_running)
    return most


def _idle_sessions(engine):
    """Two abandoned sessions of 60 prompt + 4 generated tokens: 8 blocks each, 16 of the 19."""
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for sid in (1, 2):
        req = engine.add_session_request(sid, [10 + sid + i for i in range(60)], p, sequence_start=True,
                                         sequence_end=False)
        _run(engine, [req])
    assert engine.blocks.num_usable_blocks - engine.blocks.num_free_blocks == 16


def test_idle_session_gives_way_before_a_running_request_is_preempted(engine):
    _idle_sessions(engine)
    before = engine.scheduler.num_preemptions
    # one request of 10 + 22 tokens (4 blocks): only 3 blocks are free, 16 are idle sessions'
    req = engine.add_request(list(range(20, 30)), SamplingParams(temperature=0, max_tokens=22, ignore_eos=True))
    _run(engine, [req])
    assert len(req.completions[0].token_ids) == 22
    assert engine.scheduler.num_preemptions == before, "a running request was preempted (recomputed) " \
        "while idle sessions held 16 of the 19 blocks"
    for sid in list(engine.sessions):
        engine.end_session(sid)
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_waiting_requests_are_admitted_by_evicting_idle_sessions(engine):
    _idle_sessions(engine)
    before = engine.scheduler.num_preemptions
    # three requests of 10 + 6 tokens (2 blocks each): they all fit at once once the idle sessions give way
    reqs = [engine.add_request(list(range(30 + 10 * i, 40 + 10 * i)),
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for i in range(3)]
    most = _run(engine, reqs)
    assert most == 3, f"at most {most} of 3 requests ran at once while idle sessions held the cache"
    assert engine.scheduler.num_preemptions == before
    for sid in list(engine.sessions):
        engine.end_session(sid)
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
