"""Two LLM inputs misread without a clear error.

1. A bytes prompt is taken as token ids: LLM._encode (lmjax/api/llm.py:270) sends any non-str Sequence to
   _token_ids, and bytes is a Sequence of ints, so llm.generate(b"t5") generates after token ids [116, 53] (the
   bytes' values), silently. Expected: a TypeError naming bytes (decode it first), as vLLM's prompt parsing
   refuses it.
2. A scalar of the wrong type where a list field takes "a str or a list of str" fails in list(): as_list
   (lmjax/validation.py:93) does list(value) for anything not the item type, so SamplingParams(stop=5) /
   (bad_words=5) / (stop_token_ids=3.0) / GenerationConfig(stop_words=5) raise "TypeError: 'int' object is not
   iterable", naming neither the field nor the value (stop=[5] is named: "stop must hold str values, got [5]").
"""

import pytest

from conftest import write_tiny_llama  # noqa: E402
from lmjax import GenerationConfig, LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3), max_model_len=128, block_size=16)


@pytest.mark.parametrize("prompt", [b"t5", bytearray(b"t5"), [b"t5"]])
def test_a_bytes_prompt_is_not_token_ids(llm, prompt):
    try:
        out = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    except TypeError as e:
        assert "bytes" in str(e), str(e)
        return
    pytest.fail(f"generated after prompt ids {out[0].prompt_token_ids} (the bytes' values)")


@pytest.mark.parametrize("make, name", [
    (lambda: SamplingParams(stop=5), "stop"),
    (lambda: SamplingParams(bad_words=5), "bad_words"),
    (lambda: SamplingParams(stop_token_ids=3.0), "stop_token_ids"),
    (lambda: GenerationConfig(stop_words=5), "stop_words"),
])
def test_a_scalar_of_the_wrong_type_is_named(make, name):
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert name in str(info.value), f"{type(info.value).__name__}: {info.value}"
