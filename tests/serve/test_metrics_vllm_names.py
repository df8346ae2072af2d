"""/metrics also under vLLM's names (probe 25): dashboards and autoscalers scrape vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:prefix_cache_queries / hits (a hit rate needs both: lmjax exported only the
hits), vllm:generation_tokens, vllm:request_success, each labelled with model_name."""
import re

from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)


def _samples(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_vllm_names_beside_lmjax_ones_after_known_work(http):
    before = _samples(http.get("/metrics").text)
    body = {"model": "tiny", "prompt": "t9 t8", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    after = _samples(http.get("/metrics").text)
    label = '{model_name="tiny"}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{name}{label}" in after and after[f"lmjax_{name}"] == after[f"vllm:{name}{label}"]
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew[f"vllm:generation_tokens_total{label}"] == grew["lmjax_generation_tokens_total"] == 3
    assert grew[f'vllm:request_success_total{{model_name="tiny",finished_reason="length"}}'] == 1
    assert "lmjax_prefix_cache_queries_total" in after and f"vllm:prefix_cache_hits_total{label}" in after
