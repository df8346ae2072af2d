"""A KV cache smaller than session_len: a request without max_tokens generates until the cache is full
(LMDeploy caps so; it was a ValueError naming a max_tokens the caller never gave), one that asks for more
than the cache holds is a ValueError naming its max_tokens, and the engine warns at start."""
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams


def test_requests_without_max_tokens_stop_where_the_cache_ends(tmp_path, caplog):
    tiny = write_tiny_llama(tmp_path)
    with caplog.at_level("WARNING", logger="lmjax.engine"):
        llm = LLM(tiny, max_model_len=256, block_size=16, num_gpu_blocks_override=5)
    engine = llm.llm_engine
    assert engine.cache_tokens == engine.blocks.num_usable_blocks * 16 < engine.session_len
    assert any("fewer than session_len=256" in r.getMessage() for r in caplog.records)
    prompt = {"prompt_token_ids": list(range(4, 14))}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == engine.cache_tokens - 10
    assert out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=100 needs more KV cache"):
        llm.generate(prompt, SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match=f"prompt of {engine.cache_tokens} tokens needs more KV cache"):
        llm.generate({"prompt_token_ids": [5] * engine.cache_tokens}, SamplingParams(max_tokens=None), use_tqdm=False)
