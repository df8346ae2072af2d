"""A lone surrogate in text given to the Python facades fails in the tokenizer with a TypeError that names
neither the argument nor the character.

The server refuses it by name (lmjax/serve/protocol.py _Strict._utf8: "is not valid UTF-8: it holds the lone
surrogate '\\ud800'", written "rather than the tokenizer's cryptic TypeError deep in the request"), but
LLM.generate / LLM.chat / SamplingParams(bad_words=...) / pipeline / AsyncEngine hand the str straight to the
HF tokenizer, which raises "TypeError: TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence,
InputSequence]]". Expected: a ValueError (or TypeError) naming the argument and the surrogate, as the server's."""
import asyncio

import pytest

from lmjax import GenerationConfig, LLM, SamplingParams  # noqa: E402
from tiny_server_fixtures import tiny  # noqa: F401 (pytest fixtures)

BAD = "t5 \ud800 t6"


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, max_model_len=128, block_size=16)


def _names_it(e: BaseException) -> bool:
    return "surrogate" in str(e) or "\\ud800" in str(e) or "UTF-8" in str(e)


@pytest.mark.parametrize("call", [
    lambda llm: llm.generate(BAD, SamplingParams(max_tokens=2), use_tqdm=False),
    lambda llm: llm.generate({"prompt": BAD}, SamplingParams(max_tokens=2), use_tqdm=False),
    lambda llm: llm.generate([[5, 9]], SamplingParams(max_tokens=2, bad_words=["\ud800"]), use_tqdm=False),
    lambda llm: llm.embed([BAD], use_tqdm=False),
], ids=["generate", "generate-dict", "bad_words", "embed"])
def test_llm_names_a_lone_surrogate(llm, call):
    with pytest.raises((ValueError, TypeError)) as info:
        call(llm)
    assert _names_it(info.value), f"{type(info.value).__name__}: {info.value}"


def test_the_lmdeploy_facades_name_a_lone_surrogate(tiny):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    engine = AsyncEngine(tiny, model_name="tiny", backend_config=TurbomindEngineConfig(session_len=128,
                                                                                      cache_block_seq_len=16))
    try:
        with pytest.raises((ValueError, TypeError)) as info:
            engine.batch_infer(BAD, gen_config=GenerationConfig(max_new_tokens=2))
        assert _names_it(info.value), f"batch_infer: {type(info.value).__name__}: {info.value}"

        async def stream():
            async for _ in engine.generate(BAD, 1, GenerationConfig(max_new_tokens=2), do_preprocess=False):
                pass
        with pytest.raises((ValueError, TypeError)) as info:
            asyncio.run(stream())
        assert _names_it(info.value), f"generate: {type(info.value).__name__}: {info.value}"
    finally:
        engine.close()
