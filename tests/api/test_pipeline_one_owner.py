"""A pipeline used by more than one caller (probe 24): every call now runs on the engine thread, started on
the first one, so (1) a stream_infer() left suspended while another call (pipe.chat(), pipe(), a first
pipe.generate()) steps the engine keeps its whole output (it stopped, cut short and without a finish reason,
when another caller's steps finished its requests), and (2) pipe() from two threads at once works (both
stepped the single-threaded engine: "Buffer has been deleted or donated"). A second close() does nothing."""
import asyncio
import threading

import pytest

from lmjax import GenerationConfig, pipeline

G = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _tokens(pieces):
    return [t for p in pieces for t in p.token_ids]


def test_stream_infer_interleaved_with_chat_keeps_its_whole_output(tiny):
    pipe = pipeline(tiny)
    want = pipe("t5 t6", gen_config=G, do_preprocess=False)
    stream = pipe.stream_infer("t5 t6", gen_config=G, do_preprocess=False)
    pieces = [next(stream)]
    session = pipe.chat("t7 t8 t9", gen_config=G)  # a synchronous call while the stream is suspended
    pieces += list(stream)
    assert session.response.generate_token_len == 24
    assert _tokens(pieces) == want.token_ids, f"stream cut short: {len(_tokens(pieces))} of 24 tokens"
    assert pieces[-1].finish_reason == "length"


def test_stream_infer_survives_the_engine_thread_starting(tiny):
    pipe = pipeline(tiny)
    want = pipe("t5 t6", gen_config=G, do_preprocess=False)
    stream = pipe.stream_infer("t5 t6", gen_config=G, do_preprocess=False)
    pieces = [next(stream)]

    async def other():  # LMDeploy's pipe.generate: its first use starts the engine thread
        return [o async for o in pipe.generate("t7 t8 t9", 1, G, do_preprocess=False)]
    asyncio.run(asyncio.wait_for(other(), 60))
    pieces += list(stream)
    pipe.close()
    assert _tokens(pieces) == want.token_ids, f"stream cut short: {len(_tokens(pieces))} of 24 tokens"
    assert pieces[-1].finish_reason == "length"


def test_pipe_called_from_two_threads(tiny):
    pipe = pipeline(tiny)
    prompts = ["t5 t6", "t7 t8 t9"]
    want = {p: pipe(p, gen_config=G, do_preprocess=False).token_ids for p in prompts}
    errors, got = [], []

    def work(prompt):
        try:
            for _ in range(5):
                got.append(pipe(prompt, gen_config=G, do_preprocess=False).token_ids == want[prompt])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert got == [True] * 10


def test_close_twice_after_generate(tiny):
    async def one(pipe):
        return [o async for o in pipe.generate("t5", 1, GenerationConfig(max_new_tokens=2), do_preprocess=False)]
    with pipeline(tiny) as pipe:
        asyncio.run(one(pipe))  # starts the engine thread
        pipe.close()
    # __exit__ closed it a second time: must not raise
