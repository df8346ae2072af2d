"""A request preempted in the middle of its chunked prefill is readmitted onto the blocks it computed itself.
vLLM counts neither that self-hit as the request's cached tokens nor its lookup in the prefix-cache metrics.

1. num_cached_tokens (RequestOutput.num_cached_tokens, the server's usage.prompt_tokens_details.cached_tokens)
is vLLM's "prefix cache hit of the request's first scheduling" (vllm/v1/core/sched/scheduler.py:
`if request.num_cached_tokens < 0: request.num_cached_tokens = num_computed_tokens`), as
tests/engine/test_probe24_cached_and_ntk.py says. (lmjax recorded the latest admission's hit: a request
preempted in the middle of its chunked prefill reported its own recomputed blocks as cached although nothing
was cached when it was first scheduled.)

2. vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (lmjax.serve.metrics, from LLMEngine.stats()):
vLLM's PrefixCacheStats.record(num_tokens, num_hits, preempted=request.num_preemptions > 0) puts a previously
preempted request's lookup under preempted_queries / preempted_hits, not queries / hits (vllm/v1/metrics/stats.py,
vllm/v1/core/kv_cache_manager.py), so a recompute re-hitting its own blocks does not inflate the hit rate.
(lmjax's BlockManager.match_prefix counted every lookup, a preempted sequence's readmission included; it
counts those apart now, as vLLM.)"""
from tiny_llama import write_tiny_llama

from lmjax import LLM, SamplingParams
from lmjax.api.outputs import request_output


def _run(tmp_path):
    path = write_tiny_llama(tmp_path, eos_token_id=3)
    # 12 usable blocks of 4 tokens; 4 tokens a step: b's 40-token prompt prefills 3 tokens a step beside a's decode
    llm = LLM(path, max_model_len=128, block_size=4, num_gpu_blocks_override=13, max_num_batched_tokens=4,
              max_num_seqs=4, num_scheduler_steps=1, enable_prefix_caching=True)
    engine = llm.llm_engine
    a = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    b = engine.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    first_hit = b.completions[0].seq.num_prefix_cached_tokens  # b's first scheduling: nothing cached
    assert first_hit == 0
    while engine.has_unfinished():
        engine.step()
    assert b.completions[0].seq.num_preemptions >= 1  # the scenario happened: b preempted mid-prefill
    return engine, a, b, first_hit


def test_cached_tokens_count_only_the_first_schedulings_hit(tmp_path):
    engine, a, b, first_hit = _run(tmp_path)
    out = request_output(b)
    assert out.num_cached_tokens == first_hit, out.num_cached_tokens  # was: b's own recomputed blocks


def test_a_preempted_requests_relookup_is_not_counted_as_a_prefix_cache_hit(tmp_path):
    engine, a, b, _ = _run(tmp_path)
    stats = engine.stats()
    # a and b share no prefix: only their first lookups count (vLLM), 4 + 40 queried tokens and no hit
    assert stats["prefix_cache_hits"] == 0, stats["prefix_cache_hits"]  # was: b's re-hit of its own blocks
    assert stats["prefix_cache_queries"] == 4 + 40, stats["prefix_cache_queries"]
    # the readmission's lookup, apart: b's prompt and any token it sampled before, its own blocks re-hit
    assert stats["prefix_cache_preempted_queries"] >= 40 and stats["prefix_cache_preempted_hits"] > 0
