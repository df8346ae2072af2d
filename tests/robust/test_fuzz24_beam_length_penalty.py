"""A finite but large length_penalty passes BeamSearchParams' checks and then fails the search after its first
step with an error naming nothing.

BeamSearchParams.__post_init__ (lmjax/api/beam_search.py:74-77) requires only a finite length_penalty;
get_beam_search_score (beam_search.py:123) computes cumulative_logprob / seq_len ** length_penalty in Python
floats: 11 ** 1000.0 raises OverflowError "(34, 'Numerical result out of range')", and 11 ** -1000.0 is 0.0, so
the division raises ZeroDivisionError "float division by zero". Both come after the first beam step's work.
Expected: a ValueError naming length_penalty when the params are made (or a score that cannot overflow, e.g.
computed in log space: cum / exp(length_penalty * log(seq_len)) guarded, or math.pow clipped)."""

import pytest

from conftest import write_tiny_llama  # noqa: E402
from lmjax import LLM  # noqa: E402
from lmjax.api.beam_search import BeamSearchParams  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3), max_model_len=128, block_size=16)


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0])
def test_an_extreme_length_penalty_is_named_or_served(llm, length_penalty):
    prompt = [[5, 9, 12, 14, 15, 16, 17, 18, 19, 20]]  # 10 tokens: seq_len 11 after one step
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty)
        out = llm.beam_search(prompt, params)
    except ValueError as e:
        assert "length_penalty" in str(e), repr(e)
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"length_penalty={length_penalty}: {type(e).__name__}: {e}")
    assert len(out[0].sequences) == 2
