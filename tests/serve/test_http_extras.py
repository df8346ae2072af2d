"""The server's CORS answers, GET /version and X-Request-Id ids (vLLM's and LMDeploy's), and the abort of a
request whose client goes away while it is still queued."""
import asyncio
import json

import pytest

from app_client import app_client
from tiny_server_fixtures import http, served, tiny  # noqa: F401  (fixtures)

PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_version_route(http):
    from lmjax.version import __version__

    resp = http.get("/version")
    assert resp.status_code == 200 and resp.json() == {"version": __version__}


def test_cors_allows_any_origin_by_default(http):
    """LMDeploy's and vLLM's default: every origin, method and header, no credentials."""
    resp = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "*"
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "access-control-allow-credentials" not in resp.headers
    simple = http.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert simple.headers["access-control-allow-origin"] == "*"


def test_cors_restricted_origins_and_off(tiny):
    from lmjax.serve.cors import CorsConfig

    with app_client(tiny, 128, cors=CorsConfig(("http://ui.example:8080",), allow_credentials=True)) as (_, client):
        ok = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "http://ui.example:8080"})
        assert ok.headers["access-control-allow-origin"] == "http://ui.example:8080"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = client.options("/v1/completions", headers=PREFLIGHT)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with app_client(tiny, 128, cors=None) as (_, client):
        resp = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_cors_config_refuses_what_would_be_unsafe_or_a_mistake():
    from lmjax.serve.cors import CorsConfig

    with pytest.raises(ValueError, match="allow_credentials needs explicit allow_origins"):
        CorsConfig(allow_credentials=True)
    with pytest.raises(ValueError, match="'./my-model' is not an origin"):
        CorsConfig(("http://a.example", "./my-model"))


def test_cors_command_line_options_in_both_spellings():
    from lmjax.cli import build_parser
    from lmjax.serve.cors import CorsConfig, cors_from_args

    parse = lambda *a: cors_from_args(build_parser().parse_args(["serve", "api_server", "m", *a]))  # noqa: E731
    assert parse() == CorsConfig()
    assert parse("--allow-origins", "http://a.example", "https://b.example:1", "--allow-credentials") == \
        CorsConfig(("http://a.example", "https://b.example:1"), True)
    assert parse("--allowed-origins", '["http://a.example"]', "--allowed-methods", '["GET", "POST"]') == \
        CorsConfig(("http://a.example",), allow_methods=("GET", "POST"))
    with pytest.raises(ValueError, match="'other-model' is not an origin"):
        parse("--allow-origins", "http://a.example", "other-model")


def test_x_request_id_names_the_response(http):
    """vLLM: the response id is cmpl-<X-Request-Id> (chatcmpl-, embd-), and lmjax sends the header back."""
    rid = {"X-Request-Id": "trace-42"}
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2}, headers=rid)
    assert resp.json()["id"] == "cmpl-trace-42" and resp.headers["x-request-id"] == "trace-42"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=rid) as stream:
        assert stream.headers["x-request-id"] == "trace-42"
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-trace-42"}
    embd = http.post("/v1/embeddings", json={"model": "tiny", "input": "ab"}, headers=rid)
    assert embd.json()["id"] == "embd-trace-42"
    plain = http.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2})
    assert plain.json()["id"].startswith("cmpl-") and plain.json()["id"] != "cmpl-trace-42"
    assert "x-request-id" not in plain.headers


def _asgi_post(app, path: str, body: dict):
    """Run one POST through the ASGI app whose client disconnects right after sending its body; the
    response's status (a client gone answers nobody: 499)."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")], "client": ("t", 1),
             "server": ("test", 80)}
    return app(scope, receive, send), sent


@pytest.mark.parametrize("stream, prompt", [(False, "hello"), (True, "hello"), (False, ["hello", "world"])])
def test_queued_request_of_a_client_gone_is_aborted_before_it_runs(tiny, stream, prompt):
    """With one batch slot taken by a long request, a second request waits in the queue; its client going
    away aborts it then (vLLM's with_cancellation), not when the slot frees and it would produce a token."""
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.config import GenerationConfig
    from lmjax.lmdeploy_config import TurbomindEngineConfig
    from lmjax.serve.openai_server import create_app

    engine = AsyncEngine(tiny, model_name="tiny", backend_config=TurbomindEngineConfig(
        session_len=4096, max_batch_size=1, cache_block_seq_len=16))
    try:
        async def main():
            hog = engine.generate(None, 1, GenerationConfig(max_new_tokens=4000, ignore_eos=True), input_ids=[5, 6])
            await anext(hog)  # running: the only batch slot is taken
            call, sent = _asgi_post(create_app(engine), "/v1/completions",
                                    {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream})
            await asyncio.wait_for(call, 30)
            for _ in range(100):  # (the engine thread counts the abort when it takes it)
                if (aborted := engine.finished_reasons().get("abort", 0)) >= (1 if isinstance(prompt, str) else 2):
                    break
                await asyncio.sleep(0.05)
            last = await anext(hog)
            await hog.aclose()
            return sent, aborted, last
        sent, aborted, hog_out = asyncio.run(main())
    finally:
        engine.close()
    assert sent[0]["status"] == 499
    assert aborted == (1 if isinstance(prompt, str) else 2)  # the queued request(s), while the long one still ran
    assert hog_out.finish_reason is None
