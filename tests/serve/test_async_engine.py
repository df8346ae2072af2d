"""AsyncEngine in process on SmolLM2 (float32, greedy, a few tokens): sessions reuse their KV cache and
match one request holding the whole history; many tasks share the engine; cancelling frees blocks;
LMDeploy's methods (stop_session, end_session, get_generator, batch_infer, __call__); `lmjax chat`."""
import asyncio
import io

import pytest

from lmjax.config import GenerationConfig, SamplingParams
from lmjax.lmdeploy_config import TurbomindEngineConfig

GREEDY = GenerationConfig(max_new_tokens=8)  # LMDeploy's default top_k=1: greedy


@pytest.fixture(scope="module")
def engine(smollm2_pruned):
    from lmjax.api.async_engine import AsyncEngine

    e = AsyncEngine(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=1024, dtype="float32"))
    yield e
    e.close()


def _free(engine) -> int:
    return engine.stats()["num_free_blocks"]


async def _run(engine, *args, **kwargs):
    outs = [o async for o in engine.generate(*args, **kwargs)]
    return "".join(o.response for o in outs), [t for o in outs for t in o.token_ids], outs[-1]


def test_session_turn_prefills_only_new_tokens_and_matches_whole_history(engine):
    idle = _free(engine)

    async def main():
        text1, ids1, last1 = await _run(engine, "Hi, my name is Bob.", 1, GREEDY, sequence_end=False)
        assert engine.id2step[1] == last1.input_token_len + len(ids1)
        _, turn2 = engine.encode("What is my name?", sequence_start=False, session_id=1)
        prefilled = engine.stats()["num_prefill_tokens"]
        text2, ids2, last2 = await _run(engine, "What is my name?", 1, GREEDY, sequence_start=False,
                                        sequence_end=False)
        prefilled = engine.stats()["num_prefill_tokens"] - prefilled
        assert last2.history_token_len == engine.id2step[1] - last2.input_token_len - len(ids2)
        assert prefilled == last2.input_token_len + 1  # the new turn + the previous reply's last token
        assert last2.cached_token_len == last2.history_token_len - 1
        _, prompt1 = engine.encode("Hi, my name is Bob.")
        whole = prompt1 + ids1 + turn2  # one request holding the whole history
        _, ids_whole, _ = await _run(engine, None, 2, GREEDY, input_ids=whole)
        assert ids_whole == ids2
        await engine.end_session(1)
    asyncio.run(main())
    assert _free(engine) == idle and engine.stats()["num_sessions"] == 0


def test_session_is_bounded_by_session_len(engine):
    async def main():
        await _run(engine, "Hello", 3, GREEDY, sequence_end=False)
        # LMDeploy's "run out of tokens": an empty output, finish reason "length"; the session is kept
        text, ids, last = await _run(engine, "word " * 1100, 3, GREEDY, sequence_start=False, sequence_end=False)
        assert (text, ids, last.finish_reason, last.generate_token_len) == ("", [], "length", 0)
        assert engine.id2step[3] > 0 and 3 in engine.engine.sessions
        with pytest.raises(ValueError, match="no history"):
            await _run(engine, "Hi", 4, GREEDY, sequence_start=False)
        await engine.end_session(3)
    asyncio.run(main())


def test_many_tasks_share_the_engine(engine):
    prompts = [f"Count to {i}" for i in range(12)]
    want = [r.text for r in engine(prompts, GREEDY)]  # batch_infer / __call__

    async def main():
        return await asyncio.gather(*[_run(engine, p, 100 + i, GREEDY) for i, p in enumerate(prompts)])
    assert [text for text, _, _ in asyncio.run(main())] == want


def test_cancelled_and_stopped_requests_free_their_blocks(engine):
    idle = _free(engine)
    long = GenerationConfig(max_new_tokens=500, ignore_eos=True)

    async def main():
        gen = engine.generate("Tell me a story", 20, long)
        first = await anext(gen)
        assert first.generate_token_len == 1 and _free(engine) < idle
        await gen.aclose()  # an abandoned stream (a disconnected client)

        task = asyncio.create_task(_run(engine, "Tell me a story", 21, long))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def stopped():
            return await _run(engine, "Tell me a story", 22, long)
        task = asyncio.create_task(stopped())
        while 22 not in engine._thread._running:
            await asyncio.sleep(0.05)
        await engine.stop_session(22)
        _, ids, last = await task
        assert last.finish_reason == "abort" and len(ids) < 500
    asyncio.run(main())
    for _ in range(100):
        if _free(engine) == idle:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert _free(engine) == idle


def test_non_streaming_n_stop_words_and_get_generator(engine):
    async def main():
        outs = [o async for o in engine.generate("Say hi.", 30, SamplingParams(n=2, temperature=0.8, seed=3,
                                                                               max_tokens=6), stream_response=False)]
        assert [o.index for o in outs] == [0, 1] and all(o.generate_token_len == 6 for o in outs)
        text, _, _ = await _run(engine, "Say hi.", 31, GREEDY)
        word = text.split()[0]
        stopped, _, last = await _run(engine, "Say hi.", 31, GREEDY, stop_words=[word])
        assert stopped == text[:text.index(word)] and last.finish_reason == "stop"
        gen = engine.get_generator(False, 32)
        assert "".join([o.response async for o in gen.generate("Say hi.", gen_config=GREEDY)]) == text
    asyncio.run(main())


def test_terminal_chat_keeps_the_session(engine):
    from lmjax.serve.terminal_chat import run_chat

    out = io.StringIO()
    overlong = "word " * 1100  # past session_len: the chat says so and starts a new session
    run_chat(engine, GenerationConfig(max_new_tokens=6),
             io.StringIO(f"Hi, I am Bob.\n\nWho am I?\n\n{overlong}\n\nend\n\nexit\n"), out)
    text = out.getvalue()
    assert text.count(">>> ") == 5 and "(new session)" in text
    assert "leave no room in session_len=1024; starting a new session" in text
    assert engine.stats()["num_sessions"] == 0


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(engine):
    """asyncio.run per request (how scripts and agent wrappers drive it): a generator abandoned after its
    first piece leaves a closed loop behind; its request is dropped, its blocks freed, and the engine thread
    serves the next caller."""
    idle = _free(engine)

    async def first_piece():
        async for out in engine.generate("Tell me a long story.", 40, GenerationConfig(max_new_tokens=300,
                                                                                       ignore_eos=True)):
            return out.response
    asyncio.run(first_piece())
    text, ids, _ = asyncio.run(asyncio.wait_for(_run(engine, "Hi", 41, GREEDY), timeout=120))
    assert len(ids) == GREEDY.max_new_tokens and engine._thread._thread.is_alive()
    assert _free(engine) == idle


def test_bad_request_in_a_batch_leaves_nothing_queued(engine):
    bad = GenerationConfig(max_new_tokens=2, logprobs=10**6)
    with pytest.raises(ValueError, match="logprobs"):
        engine.batch_infer(["Hi", "Yo"], gen_config=[GenerationConfig(max_new_tokens=2), bad])
    assert not engine.engine.has_unfinished() and not engine.engine.requests


def test_a_closed_engine_says_so(smollm2_pruned):
    from lmjax.api.async_engine import AsyncEngine

    e = AsyncEngine(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256, dtype="float32"))
    e.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        e.batch_infer("Hi", gen_config=GREEDY)

    async def main():
        return [o async for o in e.generate("Hi", 1, GREEDY)]
    with pytest.raises(RuntimeError, match="engine is closed"):
        asyncio.run(main())


def test_batches_stream_and_index_by_prompt(engine):
    """LMDeploy's batch_infer / stream_infer take a batch; a Response's index is its prompt's position."""
    whole = engine.batch_infer(["Hi", "Shanghai is"], gen_config=GREEDY)
    assert [r.index for r in whole] == [0, 1]
    pieces = list(engine.stream_infer(["Hi", "Shanghai is"], gen_config=GREEDY))
    for r in whole:
        assert [t for p in pieces if p.index == r.index for t in p.token_ids] == r.token_ids
    assert [t for p in engine.stream_infer("Hi", gen_config=GREEDY) for t in p.token_ids] == whole[0].token_ids


def test_new_guides_compile_outside_the_engine_thread(engine, monkeypatch):
    """A new guide (a JSON schema compiles for up to ~0.3 s) compiles in the caller's thread, generate's
    in a worker thread off the event loop, never in the engine thread, where it would stall every running
    stream; a guide that cannot compile is a ValueError naming it, raised to the caller."""
    import re
    import threading

    from lmjax import GuidedDecodingParams
    from lmjax.engine import guided

    threads = []
    compile_regex = guided.guide_regex
    monkeypatch.setattr(guided, "guide_regex", lambda g: threads.append(threading.current_thread().name)
                        or compile_regex(g))
    regex = SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-ab"))
    text, _, _ = asyncio.run(_run(engine, "Give me a code.", 901, regex))
    batch = engine.batch_infer("Pick one.", gen_config=SamplingParams(
        temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(choice=["yes", "no", "maybe"])))
    assert re.fullmatch(r"[0-9]{3}-ab", text) and batch.text in ("yes", "no", "maybe")
    assert len(threads) == 2 and "lmjax-engine" not in threads and threads[1] == threading.current_thread().name
    bad = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="unclosed"):
        asyncio.run(_run(engine, "x", 902, bad))


def test_a_turn_abandoned_by_break_frees_its_session_for_the_next_turn(engine):
    """Breaking out of `async for` over generate() drops the generator; Python schedules its close (which
    aborts the turn) for the loop's next round. A next turn on the same session started at once used to reach
    the engine before that abort: "session 7 is busy with another request". Now generate() lets a pending
    close run first when the session still has a live stream."""
    prompts = []
    encode = engine.encode
    engine.encode = lambda *a, **k: prompts.append(encode(*a, **k)[0]) or encode(*a, **k)

    async def main():
        async for _ in engine.generate("Count to twenty.", 7, GenerationConfig(max_new_tokens=64),
                                       sequence_end=False):
            break
        text, ids, last = await _run(engine, "Thanks.", 7, GREEDY, sequence_start=False, sequence_end=False)
        await engine.end_session(7)
        return ids, last
    try:
        ids, last = asyncio.run(main())
    finally:
        del engine.encode
    assert ids and last.finish_reason in ("stop", "length")
    # The next turn saw the session as the abort left it: a reply cut short, so its end marker is still owed
    # (before the engine had done the abort, the session looked closed and the marker was dropped).
    assert prompts[-1].startswith("<|im_end|>"), prompts
