"""Review 35 of vLLM's LLM API: each logprobs dict starts with the sampled (or prompt) token, as vLLM V1 orders
it (lmjax sorted by logprob: code reading `next(iter(d))` got the top token); `logprobs_mode` is accepted at
vLLM's default and refused otherwise (it was an unexpected keyword); `TextPrompt` / `TokensPrompt` are
importable from lmjax and lmjax.inputs, as from vllm."""
import pytest

from lmjax import LLM, SamplingParams
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=64, dtype="float32")


def test_each_logprobs_dict_starts_with_the_chosen_token(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=5, prompt_logprobs=5)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert all(next(iter(d)) == tid for d, tid in zip(comp.logprobs, comp.token_ids))
    assert all(next(iter(d)) == tid for d, tid in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]))
    not_top = [d for d, tid in zip(comp.logprobs, comp.token_ids) if d[tid].rank > 1]
    assert not_top, "no sampled token below the top: the order is not tested"
    for d in comp.logprobs:  # the rest from the most likely, ranked by place
        rest = list(d.values())[1:]
        assert [e.logprob for e in rest] == sorted((e.logprob for e in rest), reverse=True)


def test_logprobs_mode(path):
    with pytest.raises(NotImplementedError, match="logprobs_mode='processed_logprobs'"):
        LLM(path, logprobs_mode="processed_logprobs")
    raw = LLM(path, max_model_len=32, logprobs_mode="raw_logprobs")
    assert raw.generate("t5", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_typed_dicts(llm):
    from lmjax import TextPrompt, TokensPrompt
    from lmjax.inputs import TokensPrompt as Same

    assert TokensPrompt is Same
    greedy = SamplingParams(temperature=0, max_tokens=3)
    a = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), greedy, use_tqdm=False)[0]
    b = llm.generate(TextPrompt(prompt="t5 t6 t7"), greedy, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == llm.generate([5, 6, 7], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert b.prompt == "t5 t6 t7"
