"""check_n bounds one prompt's n, not a request's prompts x n: a 1 KB /v1/completions body holds the engine for
tens of seconds (and then minutes, hours) while a neighbour waits.

validate_request -> check_n (lmjax/engine/request.py:167) refuses n above the cache's block count, "checked
before any work: a request of n=10**9 would otherwise build 10**9 completions on the engine thread, stalling
every other request". The completions route (then lmjax/serve/openai_server.py start(); now Served.start in served.py) checked each prompt
of a prompt list alone and submits them all, so `"prompt": [[5]] * P, "n": 2048` builds P * 2048 completions on
the engine thread. Measured (tiny model, 2048 blocks): P=20 -> 40,960 sequences, 9.2 s, a 20-token neighbour
submitted after it 8.2 s instead of 0.02 s; P=100 -> 204,800 sequences, 38 s, +390 MB; linear from there (about
2 KB and 0.2 ms a sequence: P=100,000, a 600 KB body, would need ~400 GB). Expected: the request's total
(len(prompts) * n) checked as check_n checks n, a 400 naming n and the prompt count before any work."""
import time

import pytest
from fastapi.testclient import TestClient

from conftest import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig
    from lmjax.serve.openai_server import create_app

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    engine = AsyncEngine(path, model_name="tiny", backend_config=TurbomindEngineConfig(session_len=256,
                                                                                      cache_block_seq_len=16))
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield client, engine
    engine.close()


def test_prompts_times_n_past_the_cache_is_refused_before_any_work(server):
    http, engine = server
    blocks = engine.engine.blocks.num_usable_blocks
    body = {"model": "tiny", "prompt": [[5]] * 32, "n": blocks, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    got = http.post("/v1/completions", json=body)  # was: 32 * 2048 = 65,536 completions, ~15 s, then a 200
    seconds = time.perf_counter() - start
    assert got.status_code == 400, f"{got.status_code} after {seconds:.1f} s: {32 * blocks} sequences were run"
    assert "n=" in got.json()["error"]["message"]
