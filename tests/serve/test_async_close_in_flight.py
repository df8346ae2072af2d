"""AsyncEngine.close() while requests are in flight (probe 24): every waiter gets a finish ("abort") or the
engine's "closed" error. close() used to stop the engine thread without telling the sinks of its live
requests, so an `async for` over generate() and a batch_infer() in another thread waited forever."""
import asyncio
import threading
import time

import pytest

from lmjax.config import GenerationConfig

LONG = GenerationConfig(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _engine(tiny):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig
    return AsyncEngine(tiny, backend_config=TurbomindEngineConfig(session_len=512, dtype="float32"))


def test_generate_in_flight_ends_when_the_engine_closes(tiny):
    e = _engine(tiny)
    outcome = {}

    async def main():
        gen = e.generate("t1 t2", 1, LONG, do_preprocess=False)
        await anext(gen)  # the request is running
        closer = threading.Thread(target=e.close)
        closer.start()

        async def rest():
            return [o async for o in gen]
        try:
            outs = await asyncio.wait_for(rest(), 10)
            outcome["finish"] = outs[-1].finish_reason if outs else None
        except asyncio.TimeoutError:
            outcome["hang"] = True
        except Exception as ex:  # an error naming the cause is fine
            outcome["error"] = str(ex)
        closer.join(15)
    asyncio.run(main())
    assert "hang" not in outcome, "generate() never ended after close(): its waiter hangs"
    assert outcome.get("finish") == "abort" or "closed" in outcome.get("error", "")
    assert not e.engine.has_unfinished() and not e.engine.requests  # its KV blocks freed too


def test_batch_infer_in_another_thread_ends_when_the_engine_closes(tiny):
    e = _engine(tiny)
    result = {}

    def batch():
        try:
            result["out"] = e.batch_infer(["t5 t6", "t7"], gen_config=LONG, do_preprocess=False)
        except Exception as ex:  # noqa: BLE001
            result["error"] = str(ex)
    worker = threading.Thread(target=batch, daemon=True)
    worker.start()
    deadline = time.time() + 30
    while not e.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.01)
    e.close()
    worker.join(10)
    assert not worker.is_alive(), "batch_infer() never returned after close(): it waits forever"
    assert "error" in result and "closed" in result["error"] or \
        all(r.finish_reason == "abort" for r in result["out"])
