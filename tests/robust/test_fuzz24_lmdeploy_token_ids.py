"""The LMDeploy facades' token-id inputs take bools as ids and refuse numpy integers with errors that name nothing.

LLM checks prompt ids (lmjax/api/llm.py:91 _token_ids: numpy ints are ids, True is "prompt[0] must be an int
token id, got True"; tests/robust/test_robust_llm_inputs.py). pipeline.get_ppl / get_logits
(lmjax/api/pipeline.py:162-185) and AsyncEngine.generate(input_ids=...) (lmjax/api/async_engine.py:152) only run
check_token_ids, whose 0 <= t < vocab holds for True: [True, 5, 9] is scored / generated as token 1, silently.
Numpy integers, what tokenizers return with return_tensors="np", fail on the way: get_ppl([np.int64(5), ...])
"TypeError: object of type 'numpy.int64' has no len()", get_ppl(np.array([...])) "The truth value of an array
with more than one element is ambiguous", get_logits([5.7, 9.2]) "object of type 'float' has no len()".
Expected: LLM's rule everywhere: numpy ints are ids; bools, floats and strings a TypeError naming the entry."""
import asyncio

import numpy as np
import pytest

from conftest import write_tiny_llama  # noqa: E402
from lmjax import GenerationConfig, pipeline  # noqa: E402
from lmjax.lmdeploy_config import TurbomindEngineConfig  # noqa: E402


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    p = pipeline(path, backend_config=TurbomindEngineConfig(session_len=128, cache_block_seq_len=16))
    yield p
    p.close()


@pytest.mark.parametrize("method", ["get_ppl", "get_logits"])
def test_bools_are_not_token_ids(pipe, method):
    with pytest.raises(TypeError, match="True"):
        getattr(pipe, method)([5, True, 9])


def test_generate_input_ids_refuse_bools(pipe):
    async def run():
        async for _ in pipe.generate(None, 77, GenerationConfig(max_new_tokens=2), input_ids=[True, 5]):
            pass
    with pytest.raises(TypeError, match="True"):
        asyncio.run(run())


@pytest.mark.parametrize("method", ["get_ppl", "get_logits"])
def test_numpy_token_ids_are_ids(pipe, method):
    ints = getattr(pipe, method)([5, 9, 12])
    as_numpy = getattr(pipe, method)([np.int64(5), np.int64(9), np.int64(12)])
    as_array = getattr(pipe, method)(np.array([5, 9, 12]))
    assert np.allclose(np.asarray(ints[0]), np.asarray(as_numpy[0])) and np.allclose(np.asarray(ints[0]),
                                                                                      np.asarray(as_array[0]))
