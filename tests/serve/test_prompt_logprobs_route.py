"""vLLM's `prompt_logprobs` request field on /v1/completions (per choice) and /v1/chat/completions (top level):
each prompt token's logprob, its rank in the vocabulary and its text, with the K likeliest beside it; the first
position null. lmjax answered it with a 400 (session 26)."""
import pytest

from tiny_server_fixtures import http, served, tiny  # noqa: F401  (fixtures)


def _check_entries(entries, prompt_ids, k):
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for tid, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in entry and len(entry) in (k, k + 1)  # the token, and the top k (it may be one of them)
        assert sorted(v["rank"] for v in entry.values())[:k] == list(range(1, k + 1))  # the top k: ranks 1..k
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())


def test_completions_prompt_logprobs_match_the_engines(http, tiny):
    from lmjax import LLM, SamplingParams

    ids = [5, 9, 7, 11, 4]
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    _check_entries(entries, ids, 2)
    ref = LLM(tiny, max_model_len=64).generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    for tid, got, want in zip(ids[1:], entries[1:], ref[1:]):
        assert got[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-5)
        assert got[str(tid)]["rank"] == want[tid].rank


def test_chat_prompt_logprobs_cover_the_rendered_prompt(http):
    messages = [{"role": "user", "content": "t3 t4"}]
    prompt_ids = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                    "prompt_logprobs": 0})
    assert resp.status_code == 200, resp.text
    _check_entries(resp.json()["prompt_logprobs"], prompt_ids, 0)
    plain = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
    assert plain.json()["prompt_logprobs"] is None


@pytest.mark.parametrize("extra, named", [({"prompt_logprobs": -2}, "prompt_logprobs must be -1"),
                                          ({"prompt_logprobs": 1, "stream": True}, "not available with stream")])
def test_bad_prompt_logprobs_are_400s(http, extra, named):
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2, **extra})
    assert resp.status_code == 400 and named in resp.json()["error"]["message"], resp.text
