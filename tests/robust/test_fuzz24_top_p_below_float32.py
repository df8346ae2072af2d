"""A top_p in (0, float32's smallest normal) turns top-p (and top-k) filtering off: the request samples from the
whole distribution, silently.

SamplingParams accepts any 0 < top_p <= 1 (lmjax/config.py:47). The sampler packs it as float32
(lmjax/layers/sampler.py:305), where 1e-300 is 0 and 1e-39 a subnormal that XLA on CPU flushes to 0. Then in
apply_top_k_top_p (sampler.py:154-156) no position has mass_before < 0, keep_B is 0, and the threshold is
head_BS[..., -1] (index -1 wraps to the smallest kept value): every token stays. top_p=1e-30 keeps the top token
(greedy tokens here), top_p=1e-300 gives the same tokens as top_p=1 (free sampling), and with top_k=5 the
sample leaves the top 5. The same class of bug as the temperature past float32 that
tests/robust/test_robust_engine_server.py fixed. Expected: the smallest top_p keeps the top token (as vLLM's
top-p always keeps one), or a ValueError naming top_p."""

import pytest

from conftest import write_tiny_llama  # noqa: E402
from lmjax import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3), max_model_len=128, block_size=16)


def _tokens(llm, **kw):
    params = SamplingParams(**{"max_tokens": 6, "ignore_eos": True, "seed": 1, **kw})
    return list(llm.generate([[7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("top_p", [1e-39, 1e-300])
def test_a_tiny_top_p_keeps_only_the_top_token(llm, top_p):
    greedy = _tokens(llm, temperature=0)
    assert _tokens(llm, temperature=1.0, top_p=1e-30) == greedy  # a normal float32: the top token only
    try:
        got = _tokens(llm, temperature=1.0, top_p=top_p)
    except ValueError as e:  # refusing it is fine too, if it names top_p
        assert "top_p" in str(e)
        return
    assert got == greedy, f"top_p={top_p} sampled {got}; the whole distribution gives {_tokens(llm, temperature=1.0)}"


def test_a_tiny_top_p_does_not_undo_top_k(llm):
    """top_k=5 with top_p=1e-300: every sampled token must be among the 5 likeliest (logprobs=5 lists them)."""
    try:
        out = llm.generate([[7, 8]], SamplingParams(temperature=1.0, top_k=5, top_p=1e-300, max_tokens=6, seed=1,
                                                    ignore_eos=True, logprobs=5), use_tqdm=False)[0].outputs[0]
    except ValueError as e:
        assert "top_p" in str(e)
        return
    for token, entry in zip(out.token_ids, out.logprobs):
        top5 = sorted(entry, key=lambda t: entry[t].logprob, reverse=True)[:5]
        assert token in top5, f"sampled {token}, outside the top 5 {top5}"
