"""Review 33 of guided decoding and n-gram speculation: a guided row's logprobs are over the tokens its guide
allows (vLLM V1 masks the logits before its sampler; allowed_token_ids leaves them raw) and the server sends a
masked token's -inf as vLLM's -9999.0; the JSON schemas true / false; blocks that accepted drafts fill on a
request's last step reach the prefix cache; drafts are counted for vLLM's mean acceptance length; the n-gram
lookup stops growing a match that no longer occurs; a draft-model method is refused by name."""
import json
import math

import numpy as np
import pytest

from app_client import app_client
from lmjax import LLM, GuidedDecodingParams, SamplingParams
from lmjax.engine.speculative import propose
from lmjax.speculative_config import SpeculativeConfig
from tiny_llama import write_tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _logsumexp(values) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def test_guided_logprobs_are_over_the_allowed_tokens(path):
    llm = LLM(path, max_model_len=128, block_size=16)
    choice = ["t4t5", "t6t7t8", "t9"]
    guided = SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                            guided_decoding=GuidedDecodingParams(choice=choice))
    out = llm.generate(["t5 t9"], guided, use_tqdm=False)[0].outputs[0]
    assert out.text.replace(" ", "") in choice  # (the word-level vocabulary decodes with spaces)
    first = out.logprobs[0]  # three tokens may start the output: they share all the probability
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > -math.inf}
    assert len(finite) == 3 and abs(_logsumexp(finite.values())) < 1e-4, first
    assert all(math.isclose(e[t].logprob, 0.0, abs_tol=1e-5)
               for e, t in zip(out.logprobs[1:-1], out.token_ids[1:-1]))  # (each later token is forced)
    # then the complete output's EOS step: the model's EOS ids (t0, t3) share the probability
    assert out.token_ids[-1] == 3 and len(out.logprobs) == len(out.token_ids)
    last = {t: lp.logprob for t, lp in out.logprobs[-1].items() if lp.logprob > -math.inf}
    assert set(last) == {0, 3} and abs(_logsumexp(last.values())) < 1e-4
    # allowed_token_ids is applied inside vLLM's sampler, after the raw logprobs: they stay the model's
    allowed = [40, 50, 60]
    restricted = SamplingParams(temperature=0, max_tokens=1, logprobs=5, allowed_token_ids=allowed)
    entry = llm.generate(["t5 t9"], restricted, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert _logsumexp([lp.logprob for lp in entry.values()]) < -0.5  # (the top 5 of 256 do not make one)


def test_server_sends_a_masked_top_logprob_as_vllms_floor(path):
    with app_client(path, 128) as (_, http):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 8,
                "temperature": 0, "logprobs": True, "top_logprobs": 5, "guided_choice": ["t4t5", "t6"]}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        tops = [t["logprob"] for c in content for t in c["top_logprobs"]]
        assert -9999.0 in tops and min(tops) == -9999.0
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "t5", "max_tokens": 8, "temperature": 0,
                                               "logprobs": 5, "guided_choice": ["t4t5", "t6"]})
        assert r.status_code == 200 and "Infinity" not in r.text
        assert json.loads(r.text)["choices"][0]["text"].replace(" ", "") in ("t4t5", "t6")


def test_json_schema_true_and_false():
    assert json.loads(GuidedDecodingParams(json=True).json) == {} == json.loads(GuidedDecodingParams(json="true").json)
    for schema in (False, "false"):
        with pytest.raises(ValueError, match="schema false allows no value"):
            GuidedDecodingParams(json=schema)
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(json_object=False)


def test_drafts_accepted_on_the_last_step_reach_the_prefix_cache(path):
    prompt = [5, 9, 32, 30, 5, 9, 32, 30, 5, 9]
    cached = []
    for spec in (None, SPEC):
        llm = LLM(path, max_model_len=256, block_size=4, enable_prefix_caching=True, num_scheduler_steps=1,
                  speculative_config=spec)
        for max_tokens in (21, 23, 25, 30):
            llm.reset_prefix_cache()
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            follow = {"prompt_token_ids": prompt + list(out.token_ids)}
            again = llm.generate([follow], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            cached.append(again.num_cached_tokens)
        stats = llm.llm_engine.stats()
    assert cached[:4] == cached[4:], cached
    assert stats["num_accepted_tokens"] > 0 and 0 < stats["num_drafts"] <= stats["num_draft_tokens"]


def test_lookup_stops_where_the_match_ends():
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=10**6, prompt_lookup_min=1)
    ids = np.asarray([7, 1, 2, 3, 9, 1, 2, 3] * 500 + [4, 2, 3], np.int64)  # the tail's longest match is 2 tokens
    assert propose(ids, cfg, 4) == [9, 1, 2, 3]
    assert propose(ids, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=3),
                   4) == []


@pytest.mark.parametrize("value", [{"method": "eagle", "model": "some/eagle-head"}, {"model": "some/draft-model"},
                                   {"method": "draft_model", "model": "x", "num_speculative_tokens": 3}])
def test_draft_model_methods_refused_by_name(value):
    with pytest.raises(ValueError, match="is not supported by lmjax: only n-gram"):
        SpeculativeConfig.of(value)
