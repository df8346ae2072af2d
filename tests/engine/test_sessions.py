"""Interactive session turns (lmjax/engine/sessions.py) that resume a kept KV cache: only for the very
prompt it was computed for, and without waiting behind other requests' multi-step decode chains."""
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.api.batch import run_to_completion

SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return LLM(tiny, max_model_len=256, block_size=8, max_num_seqs=8).llm_engine


def _turn(engine, sid, ids, params, start):
    req = engine.add_session_request(sid, ids, params, sequence_start=start, sequence_end=False)
    run_to_completion(engine, [req])
    return req


@pytest.mark.parametrize("keep", [20, 35, 37])
def test_a_truncated_turn_recomputes_instead_of_reusing_shifted_kv(engine, keep):
    """Was: a crash in the step (20), a turn that never finished (35), or KV of other positions (37)."""
    _turn(engine, "T", list(range(10, 40)), SHORT, True)  # 30 + 6 tokens kept
    cut = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=keep, logprobs=0)
    turn = _turn(engine, "T", [200, 201, 202], cut, False)
    fresh = engine.add_request(turn.prompt_token_ids, cut)
    run_to_completion(engine, [fresh])
    assert len(turn.prompt_token_ids) == keep and turn.num_cached_tokens == 0
    assert turn.completions[0].token_ids == fresh.completions[0].token_ids
    assert turn.completions[0].cumulative_logprob == pytest.approx(fresh.completions[0].cumulative_logprob, abs=1e-5)
    engine.end_session("T")
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_a_turn_asking_prompt_logprobs_computes_its_history(engine):
    _turn(engine, "P", list(range(10, 40)), SHORT, True)
    turn = _turn(engine, "P", [200, 201], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), False)
    assert turn.prompt_logprobs[0] is None and all(e is not None for e in turn.prompt_logprobs[1:])
    engine.end_session("P")


def test_a_resumed_turn_does_not_wait_for_a_long_decode_chain(engine):
    _turn(engine, "S", [1, 2, 3, 4, 5], SHORT, True)
    long = engine.add_request(list(range(10, 30)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()  # long decodes in chained K-step calls
    turn = engine.add_session_request("S", [6, 7], SHORT, sequence_start=False, sequence_end=False)
    assert turn.num_cached_tokens > 0  # resumed on its kept KV
    steps = 0
    while not turn.finished:
        engine.step()
        steps += 1
    assert not long.finished and steps < 10  # was: only after all 200 tokens of the other request
    run_to_completion(engine, [long])
    engine.end_session("S")


def test_a_second_turn_of_a_busy_session_is_refused_and_nothing_leaks(engine):
    """Two turns of one session in flight each kept their KV under its id on finishing: the first one's blocks
    leaked for good (the synchronous engine's API; the AsyncEngine refuses a busy session already)."""
    first = engine.add_session_request("B", list(range(10, 20)), SHORT, sequence_start=True, sequence_end=False)
    with pytest.raises(ValueError, match="session B is busy"):
        engine.add_session_request("B", list(range(30, 45)), SHORT, sequence_start=True, sequence_end=False)
    run_to_completion(engine, [first])
    again = engine.add_session_request("B", [50, 51], SHORT, sequence_start=False, sequence_end=False)  # idle now
    run_to_completion(engine, [again])
    engine.end_session("B")
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
