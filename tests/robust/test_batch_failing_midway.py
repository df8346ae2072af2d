"""A batch that fails while being queued, after validation passed (here: params whose extra_args cannot be
copied, as vLLM's defensive clone copies them), leaves nothing behind (probe 25). The prompts queued before
the failing one stayed in the engine: they took KV blocks once a later call stepped it and ran to their end
for nobody. vLLM's LLM aborts the requests it already added before re-raising; so do lmjax's submit_all
(LLM, pipeline) and EngineThread.add_many (AsyncEngine.batch_infer / submit_batch)."""
import threading
import time

import pytest

from lmjax import LLM, SamplingParams
from lmjax.api.async_engine import AsyncEngine
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny")), max_model_len=256, block_size=8, max_num_seqs=8)


def _uncopyable():
    return SamplingParams(max_tokens=4, extra_args={"lock": threading.Lock()})


def _idle(engine) -> bool:
    return (not engine.requests and not engine.has_unfinished()
            and engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks)


def test_llm_generate_failing_midway_leaves_the_engine_idle(llm):
    engine = llm.llm_engine
    with pytest.raises(TypeError):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=200, ignore_eos=True), _uncopyable()],
                     use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished()
    llm.generate([[10, 11]], SamplingParams(max_tokens=1), use_tqdm=False)  # would step an orphan
    assert _idle(engine)


def test_async_batch_failing_midway_runs_nothing(llm):
    engine = llm.llm_engine
    ae = AsyncEngine.over(engine)
    try:
        with pytest.raises(TypeError):
            ae.batch_infer(["t5 t6", "t7"], [SamplingParams(max_tokens=50, ignore_eos=True), _uncopyable()],
                           do_preprocess=False)
        deadline = time.time() + 60
        while time.time() < deadline and not ae._thread.call(lambda: _idle(engine)).result():
            time.sleep(0.1)
        assert ae.finished_reasons().get("length", 0) == 0, ae.finished_reasons()
        assert ae._thread.call(lambda: _idle(engine)).result()
    finally:
        ae.close()
