"""A prompt that leaves no room in session_len: LMDeploy's facades answer it as LMDeploy does ("run out of
tokens": an empty output, finish reason "length", the rest of the batch served), vLLM's LLM raises."""
import asyncio

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, GenerationConfig, TurbomindEngineConfig, pipeline
from lmjax.engine.request import ContextOverflowError

SHORT, LONG = "t5 t6", " ".join(["t7"] * 40)  # 2 and 40 tokens; session_len 32
FOUR = GenerationConfig(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _lmdeploy_length(r, n_prompt):
    return (r.text, r.generate_token_len, r.input_token_len, r.finish_reason, r.token_ids) == \
        ("", 0, n_prompt, "length", [])


def test_pipeline_answers_an_overlong_prompt_with_an_empty_length_response(tiny):
    pipe = pipeline(tiny, backend_config=TurbomindEngineConfig(session_len=32))
    short, long = pipe([SHORT, LONG], gen_config=FOUR)
    assert short.generate_token_len == 4 and _lmdeploy_length(long, 40) and long.index == 1
    streamed = [r for r in pipe.stream_infer([LONG, SHORT], gen_config=FOUR)]
    assert _lmdeploy_length(next(r for r in streamed if r.index == 0), 40)
    assert sum(r.generate_token_len > 0 for r in streamed if r.index == 1) > 0
    assert not pipe.engine.has_unfinished() and pipe.engine.blocks.num_free_blocks == pipe.engine.blocks.num_usable_blocks
    with pytest.raises(ContextOverflowError, match="prompt of 40 tokens does not fit the context of 32"):
        LLM(tiny, max_model_len=32).generate([SHORT, LONG], use_tqdm=False)  # vLLM's error, nothing run


def test_async_engine_turns_that_overflow_end_with_length(tiny):
    from lmjax.api.async_engine import AsyncEngine

    with AsyncEngine(tiny, backend_config=TurbomindEngineConfig(session_len=32)) as engine:
        async def run(prompt, session_id, **kw):
            return [o async for o in engine.generate(prompt, session_id, FOUR, do_preprocess=False, **kw)]

        (out,) = asyncio.run(run(LONG, 1))
        assert (out.response, out.generate_token_len, out.input_token_len, out.finish_reason) == ("", 0, 40, "length")
        first = asyncio.run(run(" ".join(["t8"] * 20), 2, sequence_end=False))  # 20 + 4 tokens kept
        assert first[-1].finish_reason == "length" and 2 in engine.engine.sessions
        (kept,) = asyncio.run(run(" ".join(["t9"] * 8), 2, sequence_start=False, sequence_end=False))
        assert (kept.finish_reason, kept.history_token_len) == ("length", 24) and 2 in engine.engine.sessions
        (ended,) = asyncio.run(run(" ".join(["t9"] * 8), 2, sequence_start=False, sequence_end=True))
        assert ended.finish_reason == "length" and 2 not in engine.engine.sessions  # its last turn ends it
        mixed = engine.batch_infer([SHORT, LONG], gen_config=FOUR, do_preprocess=False)
        assert mixed[0].generate_token_len == 4 and _lmdeploy_length(mixed[1], 40)
        assert engine.stats()["num_running"] == 0
