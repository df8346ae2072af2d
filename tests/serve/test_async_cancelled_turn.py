"""A session turn cut short by task.cancel() / asyncio.wait_for, or by `break` with each turn in its own
asyncio.run(), leaves the next turn the prompt a turn cut short by `break` in one loop leaves (probe 24): the
reply was cut short, so the template's end-of-reply marker (eoa) is still owed and starts the next turn's
text. The next turn did not wait for the abandoned turn's abort, read the session while that turn still
owned it, took the reply for a closed one and dropped the marker: the model was fed a malformed history.
(The slow step makes the race deterministic; with the tiny model's ~1 ms steps it failed too.)"""
import asyncio
import contextlib
import time

import pytest

from lmjax import ChatTemplateConfig, GenerationConfig

MARKED = ChatTemplateConfig(model_name="marked", user="t9 ", eoh=" t8", assistant=" t7", eoa=" t6")
LONG = GenerationConfig(max_new_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import write_tiny_llama
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    e = AsyncEngine(tiny, backend_config=TurbomindEngineConfig(session_len=512, dtype="float32"),
                    chat_template_config=MARKED)
    step = e.engine.step

    def slow_step():  # a step as long as a real model's on a loaded server (tens of ms)
        time.sleep(0.05)
        return step()
    e.engine.step = slow_step
    yield e
    e.close()


@contextlib.contextmanager
def _recorded_prompts(engine):
    """The text of each prompt the engine encodes while inside (a session turn's rendered prompt)."""
    prompts, encode = [], engine.encode

    def recording(*args, **kwargs):
        encoded = encode(*args, **kwargs)
        prompts.append(encoded[0])
        return encoded
    engine.encode = recording
    try:
        yield prompts
    finally:
        del engine.encode


async def _next_turn(engine):
    async for _ in engine.generate("t4", 1, GenerationConfig(max_new_tokens=2), sequence_start=False,
                                   sequence_end=False):
        pass
    await engine.end_session(1)


def _next_turn_prompt(engine, stop_turn) -> str:
    async def main():
        await stop_turn(engine.generate("t5", 1, LONG, sequence_end=False))
        await _next_turn(engine)
    with _recorded_prompts(engine) as prompts:
        asyncio.run(asyncio.wait_for(main(), 60))
    return prompts[-1]


async def _by_break(gen):
    n = 0
    async for _ in gen:
        n += 1
        if n == 3:
            break


async def _by_cancel(gen):
    async def consume():
        async for _ in gen:
            pass
    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _by_timeout(gen):
    async def consume():
        async for _ in gen:
            pass
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(consume(), 0.3)


def test_break_keeps_the_owed_end_marker(engine):  # passes today: the reference behaviour
    assert _next_turn_prompt(engine, _by_break).startswith(" t6")


@pytest.mark.parametrize("stop_turn", [_by_cancel, _by_timeout], ids=["task.cancel", "wait_for-timeout"])
def test_cancelled_turn_keeps_the_owed_end_marker(engine, stop_turn):
    prompt = _next_turn_prompt(engine, stop_turn)
    assert prompt.startswith(" t6"), f"next turn after a cancelled reply lost the owed eoa marker: {prompt!r}"


def test_break_then_next_turn_in_a_new_asyncio_run_keeps_the_owed_end_marker(engine):
    async def turn1():
        await _by_break(engine.generate("t5", 1, LONG, sequence_end=False))
    with _recorded_prompts(engine) as prompts:
        asyncio.run(asyncio.wait_for(turn1(), 60))
        asyncio.run(asyncio.wait_for(_next_turn(engine), 60))
    assert prompts[-1].startswith(" t6"), f"next turn lost the owed eoa marker: {prompts[-1]!r}"
