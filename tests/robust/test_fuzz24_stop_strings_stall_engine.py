"""Many long stop strings make every engine step of their request cost seconds, on the engine thread, so one
request stalls every other request in flight.

StopStringMatcher.feed (lmjax/engine/stop.py) calls partial_stop_len each token, which for every stop tries each
prefix length n from min(len(stop) - 1, len(text)) down, slicing stop[:n] each time: O(sum over stops of
min(len(stop), len(text))**2) per token. 1000 stop strings of 1000 characters (a 1 MB body, nothing the server
refuses) cost ~50 ms a token once the output is ~1000 characters long: 200 tokens, ~9.5 s of host time.
Measured through the OpenAI server: a 100-token greedy neighbour that takes 0.02 s alone takes 6.9 s while such
a request runs. vLLM looks for each stop only in the window the new text can complete (str.find) and holds
back at most the longest stop's length less one: milliseconds for the same input."""
import threading
import time

import pytest
from fastapi.testclient import TestClient

from conftest import write_tiny_llama  # noqa: E402
from lmjax.engine.stop import StopStringMatcher  # noqa: E402

STOPS = ["x" * 999 + str(i) for i in range(1000)]  # never matched by the tiny model's " t123" words


def test_the_matcher_is_not_quadratic_in_the_stop_strings():
    matcher = StopStringMatcher(STOPS)
    start = time.perf_counter()
    for i in range(200):
        assert matcher.feed(f" t{i % 256}").stopped is False
    seconds = time.perf_counter() - start
    assert seconds < 1.5, f"200 tokens against 1000 stop strings of 1000 chars took {seconds:.1f} s of host time"
    # (what a fix must keep: a stop split over tokens is held back, then cut)
    m = StopStringMatcher(["t5 t6"])
    first, last = m.feed(" t4 t5"), m.feed(" t6")
    assert not first.stopped and last.stopped and first.text + last.text == " t4 "


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig
    from lmjax.serve.openai_server import create_app

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    engine = AsyncEngine(path, model_name="tiny", backend_config=TurbomindEngineConfig(session_len=256,
                                                                                      cache_block_seq_len=16))
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield client
    engine.close()


def test_a_neighbour_is_not_stalled_by_a_request_with_many_stop_strings(http):
    good = {"model": "tiny", "prompt": [7, 8], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    http.post("/v1/completions", json=good)  # compile
    start = time.perf_counter()
    alone = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    alone_s = time.perf_counter() - start
    bad = {"model": "tiny", "prompt": [5, 9], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stop": STOPS}
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("bad", http.post("/v1/completions", json=bad)))
    worker.start()
    time.sleep(0.5)  # the bad request is decoding
    start = time.perf_counter()
    got = http.post("/v1/completions", json=good)
    with_bad_s = time.perf_counter() - start
    worker.join()
    assert got.json()["choices"][0]["text"] == alone
    assert done["bad"].status_code == 200
    assert with_bad_s < 2.0, f"the neighbour took {with_bad_s:.1f} s (alone: {alone_s:.2f} s)"
