"""Dynamic NTK through the engine: the greedy tokens of transformers' `generate` (its prompt rotated with
the base of the whole prompt's length, each later token with its own), however the engine schedules the
prompt: in one prefill or in chunks, after a prefix-cache hit, recomputed after a preemption."""
import numpy as np
import pytest
import torch
import transformers

from conftest import TINY_LLAMA
from lmjax import LLM, SamplingParams

DYNAMIC = dict(TINY_LLAMA, max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
               initializer_range=0.2)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    import sys

    from conftest import REPO

    sys.path.insert(0, f"{REPO}/benchmarks")
    from random_model import write_tokenizer

    path = tmp_path_factory.mktemp("dynamic")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DYNAMIC)).eval()
    model.save_pretrained(path)
    write_tokenizer(DYNAMIC["vocab_size"], str(path))
    return str(path), model.state_dict()


def _hf_greedy(state, prompt):
    """transformers' generate on a fresh model (its dynamic rotary embedding keeps state between calls)."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DYNAMIC)).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, DYNAMIC["vocab_size"], n).tolist() for n in lengths]


def test_chunked_prefill_and_a_prefix_cache_hit_keep_transformers_tokens(dynamic):
    path, state = dynamic
    prompt = _prompts(1, [40])[0]  # past max_position_embeddings = 24
    want = _hf_greedy(state, prompt)
    assert _greedy(LLM(path, max_model_len=96), [prompt]) == [want]
    chunked = LLM(path, max_model_len=96, max_num_batched_tokens=16)
    assert _greedy(chunked, [prompt]) == [want]
    cached = LLM(path, max_model_len=96, block_size=16, enable_prefix_caching=True)
    other = prompt[:32] + _prompts(5, [20])[0]  # the same first 32 tokens, another length (another base)
    assert _greedy(cached, [other]) == [_hf_greedy(state, other)]
    assert _greedy(cached, [prompt]) == [want]
    assert _greedy(cached, [prompt]) == [want]  # the same prompt again: its own blocks are shared
    assert cached.llm_engine.blocks.prefix_cache_hits == 32  # 2 blocks of the repeat, none across lengths


def test_short_prompts_share_blocks_and_recompute_after_preemption(dynamic):
    path, state = dynamic
    prompts = _prompts(11, [20, 23, 22, 21])  # within the trained context, generation goes past it
    want = [_hf_greedy(state, p) for p in prompts]
    llm = LLM(path, max_model_len=96, block_size=8, num_gpu_blocks_override=10, num_scheduler_steps=1)
    assert _greedy(llm, prompts) == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    cached = LLM(path, max_model_len=96, block_size=8, enable_prefix_caching=True)
    assert _greedy(cached, [prompts[0]]) == [want[0]]
    mixed = prompts[0][:16] + prompts[1][16:]
    assert _greedy(cached, [mixed]) == [_hf_greedy(state, mixed)]
    assert cached.llm_engine.blocks.prefix_cache_hits == 16  # below the trained context lengths share blocks


def test_the_default_context_is_the_scaled_one_and_vllm_bounds_max_model_len(dynamic, monkeypatch):
    """vLLM's and LMDeploy's derived length: max_position_embeddings (24) x the dynamic factor (4); a longer
    max_model_len is vLLM's error unless allowed (LMDeploy's session_len is not bounded)."""
    from lmjax import TurbomindEngineConfig, pipeline

    path, _ = dynamic
    assert LLM(path).llm_engine.session_len == 96
    with monkeypatch.context() as m:  # checked from the config alone, before the weights load
        m.setattr("lmjax.engine.engine.load_model", lambda *a, **k: pytest.fail("loaded the weights"))
        with pytest.raises(ValueError, match="max_model_len=97 is longer than the model's context of 96 tokens"):
            LLM(path, max_model_len=97)
    monkeypatch.setenv("LMJAX_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(path, max_model_len=97).llm_engine.session_len == 97
    monkeypatch.delenv("LMJAX_ALLOW_LONG_MAX_MODEL_LEN")
    assert pipeline(path, backend_config=TurbomindEngineConfig(session_len=200)).engine.session_len == 200
