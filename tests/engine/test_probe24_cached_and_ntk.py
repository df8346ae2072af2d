"""Two scheduler findings (probe 24), tiny random Llamas, float32 on CPU:
- num_cached_tokens (RequestOutput, GenOut.cached_token_len, the server's cached_tokens) counts the prompt's
  prefix-cache hit, as vLLM (set when the request is first scheduled): a request preempted and recomputed hit
  its own output blocks too, reporting more cached tokens than its prompt has;
- dynamic NTK: a session turn whose prompt passes max_position_embeddings resumed on the kept KV, whose keys
  were rotated with the earlier, shorter prompt's base, when a batch slot was free; with the batch full it
  recomputed with its own length's base: its tokens depended on the engine's load. It now recomputes (the
  prefix cache refuses such blocks already: their cache_salt differs)."""
from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.api.batch import run_to_completion
from lmjax.api.outputs import request_output


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_num_cached_tokens_never_exceeds_the_prompt_after_a_preemption(tmp_path):
    # 15 usable blocks of 4 tokens: a (8 + 40 tokens) and b (4 + 40) cannot both finish, b is preempted
    llm = LLM(write_tiny_llama(tmp_path), max_model_len=256, block_size=4, max_num_seqs=8,
              num_gpu_blocks_override=16, enable_prefix_caching=True, num_scheduler_steps=1)
    engine = llm.llm_engine
    a = engine.add_request(list(range(10, 18)), _greedy(40))
    b = engine.add_request(list(range(30, 34)), _greedy(40))
    run_to_completion(engine, [a, b])
    assert b.completions[0].seq.num_preemptions >= 1  # the scenario happened
    for r in (a, b):
        out = request_output(r)
        assert out.num_cached_tokens <= len(out.prompt_token_ids), (out.num_cached_tokens, out.prompt_token_ids)


def _two_turns(llm, busy: bool):
    e = llm.llm_engine
    t1 = e.add_session_request("s", list(range(10, 20)), _greedy(20), sequence_start=True, sequence_end=False)
    run_to_completion(e, [t1])  # 10 + 20 tokens kept: past max_position_embeddings=24
    other = []
    if busy:  # the only batch slot is taken when the next turn arrives
        other = [e.add_request([7, 8, 9], _greedy(30))]
        e.step()
    t2 = e.add_session_request("s", [50, 51, 52, 53], _greedy(8), sequence_start=False, sequence_end=True)
    run_to_completion(e, [t2] + other)
    return t2


def test_a_dynamic_ntk_turn_gives_the_same_tokens_whatever_the_load(tmp_path):
    path = write_tiny_llama(tmp_path, max_position_embeddings=24, initializer_range=0.2,
                            rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    kw = dict(max_model_len=96, block_size=8, max_num_seqs=1, num_scheduler_steps=1)
    idle = _two_turns(LLM(path, **kw), busy=False)
    busy = _two_turns(LLM(path, **kw), busy=True)
    e = LLM(path, **kw).llm_engine
    fresh = e.add_request(idle.prompt_token_ids, _greedy(8))
    run_to_completion(e, [fresh])
    assert busy.completions[0].token_ids == fresh.completions[0].token_ids
    assert idle.completions[0].token_ids == busy.completions[0].token_ids, "output depends on batch occupancy"
