"""An idle served engine hands its compile worker, after warm-up, the programs of plain temperature sampling and of
the checkpoint's sampling defaults (lmjax.engine.prefetch): a sampled request met afterwards decodes K steps a call
from its first decode call, with no new program to compile, and the same tokens."""
import asyncio
import json
import os
import time

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.engine.prefetch import PLAIN_SAMPLING, prefetch_rows

PROMPTS = [{"prompt_token_ids": list(range(4, 4 + n))} for n in (11, 23, 6)]
SAMPLED = SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    with open(os.path.join(path, "generation_config.json"), "w") as f:  # Llama-3-Instruct's kind of defaults
        json.dump({"temperature": 0.6, "top_p": 0.9, "do_sample": True}, f)
    return path


def _llm(tiny, monkeypatch, prefetch: str) -> LLM:
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")
    monkeypatch.setenv("LMJAX_PREFETCH_SAMPLING", prefetch)
    return LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, enable_prefix_caching=False,
               max_num_seqs=8, max_num_batched_tokens=256)


def _idle_until_done(engine, timeout_s: float = 600) -> None:
    """What the idle engine thread does (lmjax.api.engine_thread), until no prefetch remains (on a GPU: five table
    widths for each batch bucket, a compilation of seconds each)."""
    deadline = time.monotonic() + timeout_s
    while engine.idle_work():
        assert time.monotonic() < deadline, f"prefetch not done in {timeout_s} s"
        time.sleep(0.01)
    engine.runner.wait_for_compiles()


def _sampled_tokens(llm) -> list:
    return [c.token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False) for c in o.outputs]


def test_prefetch_rows_are_plain_sampling_and_the_checkpoints_defaults():
    rows = prefetch_rows({"temperature": 0.6, "top_p": 0.9})
    assert [(r.params.temperature, r.params.top_p) for r in rows] == [(PLAIN_SAMPLING.temperature, 1.0), (0.6, 0.9)]
    assert len(prefetch_rows({})) == len(prefetch_rows({"temperature": 0.0})) == 1  # greedy defaults: warmed up
    assert len(prefetch_rows({"top_k": -5})) == 1  # defaults SamplingParams refuses: no variant of theirs to expect


def test_idle_engine_compiles_sampled_decode_calls_before_they_are_met(tiny, monkeypatch):
    without = _llm(tiny, monkeypatch, "0")
    assert without.llm_engine.prefetch is None
    want = _sampled_tokens(without)
    assert without.llm_engine.runner._decode.num_background > 0  # met: handed over then, decoding one step a call

    llm = _llm(tiny, monkeypatch, "1")
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    _idle_until_done(engine)
    assert engine.prefetch.num_handed > 0
    handed, loops = runner._decode.num_background, engine.num_decode_loops
    assert handed > 0
    assert _sampled_tokens(llm) == want
    assert runner._decode.num_background == handed  # nothing new to compile
    assert engine.num_decode_loops > loops
    # The checkpoint's defaults (top-p) as a request leaves its sampling out: nothing new for its decode calls.
    llm.generate(PROMPTS, llm.get_default_sampling_params().clone(), use_tqdm=False)
    assert runner._decode.num_background == handed


def test_the_engine_thread_prefetches_while_idle(tiny, monkeypatch):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.config import GenerationConfig

    llm = _llm(tiny, monkeypatch, "1")
    runner = llm.llm_engine.runner
    served = AsyncEngine.over(llm.llm_engine)

    async def one():
        return [o async for o in served.generate(None, 1, GenerationConfig(max_new_tokens=4, temperature=0.7,
                                                                           top_k=0, random_seed=3),
                                                 input_ids=list(range(4, 24)))]
    try:
        deadline = time.monotonic() + 600
        while llm.llm_engine.prefetch._next is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # no request: the idle thread hands the programs over, one when the worker is free
        assert llm.llm_engine.prefetch._next is None and runner._decode.num_background > 1
        assert asyncio.run(one())  # and it still serves
    finally:
        served.close()
