"""Robustness of what reaches one engine through vLLM's LLM: a request whose sampling row cannot be packed into
the step's arrays fails alone (nothing reached the device, so its batch neighbours go on); a logits processor
that leaves nothing to sample from ends its request with "error" instead of sampling garbage; prompt token ids
as numpy integers are ids, bools are not. Tiny random Llama (word-level vocabulary t0..t255, t3 ends a
sequence)."""
import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLM(path, max_model_len=128, block_size=16)


def _greedy(max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(engine, requests) -> None:
    for _ in range(200):
        if all(r.finished for r in requests):
            return
        engine.step()
    raise AssertionError("the requests did not finish")


def test_a_row_that_cannot_be_packed_fails_alone(llm):
    """A value no check caught (here set after validation: an id past int32) fails the packing of the step's
    sampling arrays. Before: the OverflowError left engine.step, and EngineThread then failed every live
    request; now only the request whose row cannot be packed ends, with "error" naming the cause."""
    engine = llm.llm_engine
    alone = llm.generate([[5, 9, 12]], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    good = engine.add_request([5, 9, 12], _greedy())
    bad = engine.add_request([7, 8], _greedy())
    bad.params.bad_token_ids = [2**31]  # past validation: what a missed check would let through
    _run(engine, [good, bad])
    assert good.completions[0].token_ids == alone and good.completions[0].finish_reason == "length"
    assert bad.completions[0].finish_reason == "error"
    assert "int32" in bad.error, bad.error
    assert not engine.has_unfinished()


@pytest.mark.parametrize("poison", [
    lambda logits: logits * np.nan,
    lambda logits: np.where(np.arange(logits.shape[0]) == 7, np.nan, logits),  # one NaN is enough
    lambda logits: np.full_like(logits, -np.inf),
])
def test_a_processor_that_leaves_nothing_to_sample_ends_its_request(llm, poison):
    """Before: NaN or all -inf logits were sampled anyway (the argmax of NaNs is id 0), finish reason
    "length"; the batch's other request is unaffected either way."""
    outs = llm.generate([[5, 9, 12], [7, 8]],
                        [_greedy(), _greedy(logits_processors=[lambda ids, logits: poison(logits)])], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 6
    assert outs[1].outputs[0].finish_reason == "error"


def test_numpy_token_ids_are_ids_and_bools_are_not(llm):
    """Before: [np.int64(5), ...] was a TypeError ("a prompt must be a str, a list of token ids ..."), while
    {"prompt_token_ids": [True, ...]} ran as token 1."""
    ints = llm.generate([[5, 9, 12]], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    as_numpy = llm.generate([np.int64(5), np.int64(9), np.int64(12)], _greedy(), use_tqdm=False)
    assert as_numpy[0].outputs[0].token_ids == ints and as_numpy[0].prompt_token_ids == [5, 9, 12]
    from_array = llm.generate({"prompt_token_ids": np.array([5, 9, 12])}, _greedy(), use_tqdm=False)
    assert from_array[0].outputs[0].token_ids == ints
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\] must be an int token id, got True"):
        llm.generate({"prompt_token_ids": [5, True, 12]}, _greedy(), use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompt\[0\] must be an int token id, got True"):
        llm.generate([[True, 9]], _greedy(), use_tqdm=False)
