"""A session turn abandoned with its event loop (asyncio.run per request) is aborted through the engine
thread's "consumer is gone" path, which skipped the end-of-request bookkeeping (probe 24): the kept history
was missing from `id2step` (LMDeploy's count of a session's kept tokens) and the abort was not counted in
finished_reasons() (/metrics). Both now as for an abort reached with the loop alive."""
import asyncio
import time

import pytest

from lmjax import GenerationConfig

LONG = GenerationConfig(max_new_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import write_tiny_llama
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    e = AsyncEngine(write_tiny_llama(tmp_path_factory.mktemp("tiny")),
                    backend_config=TurbomindEngineConfig(session_len=512, dtype="float32"))
    step = e.engine.step

    def slow_step():  # a real model's step: the loop is gone before the engine thread next delivers
        time.sleep(0.05)
        return step()
    e.engine.step = slow_step
    yield e
    e.close()


def _idle(engine):
    for _ in range(200):
        if not engine.engine.has_unfinished() and not engine._thread._live:
            return
        time.sleep(0.05)
    raise AssertionError("the engine never went idle")


def test_turn_abandoned_with_its_loop_keeps_id2step_and_counts_the_abort(engine):
    async def first_piece():
        async for _ in engine.generate("t5 t6", 1, LONG, sequence_end=False, do_preprocess=False):
            return
    before = engine.finished_reasons().get("abort", 0)
    asyncio.run(first_piece())  # the loop closes with the stream abandoned
    _idle(engine)
    assert 1 in engine.engine.sessions  # the history is kept (sequence_end=False)
    kept = engine.engine.sessions[1].num_tokens
    assert engine.id2step.get(1) == kept, f"id2step lacks the kept session ({kept} tokens): {engine.id2step}"
    assert engine.finished_reasons().get("abort", 0) == before + 1
    engine.end_session(1).result()


def test_request_abandoned_with_its_loop_is_counted_as_aborted(engine):
    async def first_piece():
        async for _ in engine.generate("t7", 2, LONG, do_preprocess=False):
            return
    before = sum(engine.finished_reasons().values())
    asyncio.run(first_piece())
    _idle(engine)
    assert sum(engine.finished_reasons().values()) == before + 1, engine.finished_reasons()
