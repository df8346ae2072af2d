"""A session's next turn starts only once the engine has done what ended its last one (an abort, a stop), however
that was asked for and whoever stops waiting (review 32). The engine's steps are slowed, as a real model's step on
a busy GPU is, so the next turn always arrives while that abort or stop is still queued behind a step."""
import asyncio
import logging
import time

import pytest

from app_client import app_client
from lmjax.messages import GenerationConfig

LONG = GenerationConfig(max_new_tokens=200, top_k=1, ignore_eos=True)
SHORT = GenerationConfig(max_new_tokens=2, top_k=1)


@pytest.fixture(scope="module")
def served(smollm2_pruned):
    with app_client(smollm2_pruned, 512) as (engine, client):
        step = engine.engine.step

        def slow_step():
            time.sleep(0.3)
            return step()
        engine.engine.step = slow_step
        yield engine, client


async def _consume(gen) -> list:
    return [o async for o in gen]


async def _abandoned_turn(engine, session_id: int) -> None:
    """A first turn kept open (sequence_end=False), then abandoned mid-reply: its abort waits behind a step."""
    first = asyncio.create_task(_consume(engine.generate("Hi", session_id, LONG, sequence_end=False)))
    await asyncio.sleep(1.0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


def _next_turn_text(engine, session_id: int, outs) -> str:
    n = outs[-1].input_token_len
    return engine.tokenizer.decode(engine.engine.sessions[session_id].prompt_token_ids[-n:])


def test_a_cancelled_waiter_leaves_the_abort_to_the_others(served, caplog):
    engine, _ = served

    async def main():
        await _abandoned_turn(engine, 1)
        t2 = asyncio.create_task(_consume(engine.generate("next", 1, SHORT, sequence_start=False, sequence_end=False)))
        t3 = asyncio.create_task(_consume(engine.generate("other", 1, SHORT, sequence_start=False, sequence_end=False)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # both wait for the one abort now
        t2.cancel()
        return await asyncio.gather(t2, t3, return_exceptions=True)
    with caplog.at_level(logging.ERROR):
        cancelled, other = asyncio.run(main())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert not isinstance(other, BaseException), other
    assert _next_turn_text(engine, 1, other).startswith("<|im_end|>")  # the stopped reply's owed end marker
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    engine.end_session(1).result()


@pytest.mark.parametrize("how", ["await stop_session", "get_generator(stop=True)"])
def test_a_turn_after_a_stop_keeps_the_stopped_replys_end_marker(served, how):
    engine, _ = served
    sid = 2 if how.startswith("await") else 3

    async def main():
        first = asyncio.create_task(_consume(engine.generate("Hi", sid, LONG, sequence_end=False)))
        await asyncio.sleep(1.0)
        if how == "await stop_session":
            await engine.stop_session(sid)
            handle = engine.get_generator(False, sid)
        else:
            handle = engine.get_generator(True, sid)  # LMDeploy's: stops without waiting
        outs = await _consume(handle.generate("next", gen_config=SHORT, sequence_start=False, sequence_end=False))
        await first
        return outs
    outs = asyncio.run(main())
    assert _next_turn_text(engine, sid, outs).startswith("<|im_end|>\n<|im_start|>user\nnext")
    engine.end_session(sid).result()


def test_cancelling_the_wait_for_end_session_logs_no_error(served, caplog):
    engine, _ = served

    async def main():
        busy = asyncio.create_task(_consume(engine.generate("busy", 5, GenerationConfig(max_new_tokens=20, top_k=1))))
        await asyncio.sleep(0.5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.end_session(5), timeout=0.01)
        await asyncio.gather(busy, return_exceptions=True)
        await asyncio.sleep(0.5)
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 5 not in engine.engine.sessions  # the end was done all the same


def test_interactive_next_turn_waits_for_the_abandoned_turns_abort(served):
    """A web UI's stop button: the client drops the stream and sends the next turn at once."""
    engine, client = served
    asyncio.run(_abandoned_turn(engine, 7))  # its abort still queued behind a slow step
    body = {"prompt": "What did I say?", "session_id": 7, "interactive_mode": True, "request_output_len": 2,
            "temperature": 0}
    r = client.post("/v1/chat/interactive", json=body)
    assert r.status_code == 200, r.text
    line = r.json()
    assert line["history_tokens"] > 0 and line["input_tokens"] < 20, line  # the session went on (no new system prompt)
    engine.end_session(7).result()
