"""Review 33 of the server's usage and metrics: vLLM's stream_options (include_usage defaults to true once given;
continuous_usage_stats puts the usage so far in every chunk), embeddings are no generated tokens and finish
"stop" (vLLM's pooling requests), a prompt's last token computed by a multi-step decode call counts as prefilled,
and /metrics labels vLLM's names with the name the app serves."""
import json
import re

import pytest

from app_client import app_client
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    with app_client(path, 64, enable_prefix_caching=True, model_name="served-name") as (engine, client):
        yield engine, client


def _samples(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _grew(http, run) -> dict[str, float]:
    before = _samples(http.get("/metrics").text)
    run()
    after = _samples(http.get("/metrics").text)
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def _chunks(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={"model": "served-name", "stream": True, "max_tokens": 3,
                                          "temperature": 0, "ignore_eos": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("route,body", [("/v1/completions", {"prompt": "t5 t6"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]})])
def test_stream_options_as_vllm(served, route, body):
    _, http = served
    plain = _chunks(http, route, body)
    assert all(c.get("usage") is None for c in plain)  # no stream_options: no usage (OpenAI's)
    given = _chunks(http, route, {**body, "stream_options": {}})
    assert given[-1]["choices"] == [] and given[-1]["usage"]["completion_tokens"] == 3
    assert all(c.get("usage") is None for c in given[:-1])
    running = _chunks(http, route, {**body, "stream_options": {"continuous_usage_stats": True}})
    final = running[-1]["usage"]
    assert running[-1]["choices"] == [] and final["completion_tokens"] == 3
    counts = [c["usage"]["completion_tokens"] for c in running[:-1]]
    assert counts == sorted(counts) and counts[-1] == 3, counts  # (a multi-step call may bring all 3 at once)
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in running)
    off = _chunks(http, route, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in off)  # (vLLM's: continuous usage takes include_usage)


def test_embeddings_are_no_generated_tokens(served):
    _, http = served
    grew = _grew(http, lambda: http.post("/v1/embeddings", json={"model": "served-name", "input": ["t5 t6", "t7"]}))
    assert "lmjax_generation_tokens_total" not in grew and grew["lmjax_prompt_tokens_total"] == 3
    assert grew['lmjax_request_finished_total{finished_reason="stop"}'] == 2
    assert not any("length" in k for k in grew)


@pytest.mark.parametrize("prompt", [[5], list(range(30, 63))])  # one token; then 32 of 33 from the prefix cache
def test_prompt_token_computed_by_a_decode_call_counts(served, prompt):
    _, http = served
    body = {"model": "served-name", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    http.post("/v1/completions", json=body)  # (a second run of the 33 hits the prefix cache)
    usage = {}
    grew = _grew(http, lambda: usage.update(http.post("/v1/completions", json=body).json()["usage"]))
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert computed == 1 and grew["lmjax_prompt_tokens_total"] == 1, (usage, grew)


def test_metrics_labelled_with_the_served_name(served):
    _, http = served
    text = http.get("/metrics").text
    assert set(re.findall(r'model_name="([^"]*)"', text)) == {"served-name"}
