"""vLLM's LLM utilities beyond generate/chat: reset_prefix_cache (between benchmark runs) and
start_profile / stop_profile (a JAX profiler trace)."""
import os

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams

PROMPT = {"prompt_token_ids": list(range(5, 5 + 40))}  # two full 16-token blocks and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny")), max_model_len=128, block_size=16,
               enable_prefix_caching=True)


def test_reset_prefix_cache(llm):
    first = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert llm.reset_prefix_cache() is True
    after = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request(PROMPT["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=50))
    engine.step()  # a running request holds blocks: not reset (vLLM's answer), nothing lost
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished():
        engine.step()
    assert llm.llm_engine.blocks.hash_to_block and llm.reset_prefix_cache() is True
    assert not llm.llm_engine.blocks.hash_to_block


def test_profile_writes_a_trace(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("LMJAX_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="LMJAX_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("LMJAX_PROFILER_DIR", str(tmp_path))
    llm.start_profile()
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.stop_profile()
    traces = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".xplane.pb")]
    assert traces
