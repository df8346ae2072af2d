"""LMDeploy's pipeline is an AsyncEngine (seed 000/001): `pipe.generate` (async, sessions), `stop_session`,
`end_session`, `get_generator`, `session_len`, `id2step` (lagent's AsyncLMDeployPipeline calls
`pipe.generate`). Every call runs on the pipeline's engine thread (started by the first), so async streams
and synchronous batches share the engine safely."""
import asyncio
import threading

import pytest

from conftest import write_tiny_llama
from lmjax import GenerationConfig, pipeline

GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


async def _collect(pipe, prompt, session_id, **kw):
    return [t async for out in pipe.generate(prompt, session_id, GREEDY, do_preprocess=False, **kw)
            for t in out.token_ids]


def test_pipeline_serves_asyncengine_methods_beside_its_own(tiny):
    pipe = pipeline(tiny)
    want = pipe(["t5 t6", "t7"], gen_config=GREEDY, do_preprocess=False)  # starts the engine thread
    assert pipe._async_engine is not None and pipe.session_len == pipe.engine.session_len
    assert asyncio.run(_collect(pipe, "t5 t6", 1)) == want[0].token_ids
    asyncio.run(_collect(pipe, "t7", 2, sequence_end=False))  # a session kept for its next turn
    assert pipe.id2step[2] == 1 + 24 and 2 in pipe.engine.sessions
    pipe.end_session(2).result()
    assert 2 not in pipe.engine.sessions and pipe.get_generator(False, 3) is not None

    got, errors = {}, []

    def stream():  # an async caller on its own thread while the main thread runs synchronous batches
        try:
            got["async"] = asyncio.run(_collect(pipe, "t7", 4))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    worker = threading.Thread(target=stream)
    worker.start()
    again = pipe(["t5 t6", "t7"], gen_config=GREEDY, do_preprocess=False)
    streamed = [r for r in pipe.stream_infer(["t5 t6"], gen_config=GREEDY, do_preprocess=False)]
    ppl = pipe.get_ppl([5, 6, 7, 8])
    worker.join(timeout=120)
    assert not errors and got["async"] == want[1].token_ids
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
    assert [t for r in streamed for t in r.token_ids] == want[0].token_ids and ppl[0] > 0
    assert not pipe.engine.has_unfinished()
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe(["t5"], gen_config=GREEDY)
