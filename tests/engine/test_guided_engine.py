"""Guided decoding and allowed_token_ids in the engine, on a tiny random Llama (its word-level vocabulary
t0..t255: token "t4" is the 2 bytes b"t4"; t0 and t3 end a sequence): guided rows decode one step at a
time with the mask their guide state allows and end when the guide is complete, other rows of the batch
are untouched (same tokens as alone, multi-step calls as before), a fixed allowed_token_ids mask rides in
multi-step calls, and a bad guide is a ValueError at submission that harms no running request."""
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, GuidedDecodingParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLM(path, max_model_len=256, block_size=16)  # num_scheduler_steps 8: multi-step decode is on


PLAIN = SamplingParams(temperature=0, max_tokens=20)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_guided_rows_follow_their_guide_and_leave_the_others_alone(llm):
    engine = llm.llm_engine
    loops = engine.num_decode_loops
    alone = _tokens(llm, [[5, 9, 12, 30]], PLAIN)[0]
    assert engine.num_decode_loops > loops  # alone, the unguided request decodes K steps per call
    regex = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(regex="(t4|t5){2,5}t6"))
    choice = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=GuidedDecodingParams(choice=["t7t8", "t9"]))
    outs = llm.generate([[5, 9, 12, 30], [7, 8, 9], [40, 41]], [PLAIN, regex, choice], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    guided = outs[1].outputs[0]
    # A stale mask (the guide not advanced between steps) would never allow t6.
    assert guided.token_ids[-2:] == [6, 3] and set(guided.token_ids[:-2]) <= {4, 5} and 4 <= len(guided.token_ids) <= 7
    # the guide complete, its mask let EOS alone through: the model sampled it, which ended the output (vLLM's)
    assert guided.finish_reason == "stop"
    assert outs[2].outputs[0].token_ids in ([7, 8, 3], [9, 3]) and outs[2].outputs[0].finish_reason == "stop"
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_allowed_token_ids_restrict_every_token(llm):
    engine = llm.llm_engine
    loops = engine.num_decode_loops
    # (sampled rows under a mask: tests/layers/test_sampler_allowed.py; each flag set here costs a compilation)
    params = [SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=[10, 11, 12]),
              SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=[20, 3])]  # EOS 3 allowed: it may end
    first, second = _tokens(llm, [[5, 6, 7], [8, 9]], params)
    assert len(first) == 24 and set(first) <= {10, 11, 12} and set(second) <= {20, 3}
    # A fixed mask needs no host between steps: multi-step, once its variant has compiled in the background
    # (until then, single steps), with the same tokens.
    engine.runner.wait_for_compiles()
    assert _tokens(llm, [[5, 6, 7], [8, 9]], params) == [first, second]
    assert engine.num_decode_loops > loops
    with pytest.raises(ValueError, match=r"allowed_token_ids \[256\] are outside the vocabulary \[0, 256\)"):
        llm.generate([[5]], SamplingParams(allowed_token_ids=[5, 256]), use_tqdm=False)


@pytest.mark.parametrize("guided, named", [
    (GuidedDecodingParams(json={"type": "nonsense"}), "json=.*nonsense.* cannot be compiled"),
    (GuidedDecodingParams(regex="(unclosed"), r"regex='\(unclosed' cannot be compiled"),
    (GuidedDecodingParams(json_object=True), "no token that can begin.*json_object="),  # no "{" in t0..t255
])
def test_bad_guide_fails_at_submission_and_harms_no_running_request(llm, guided, named):
    engine = llm.llm_engine
    alone = _tokens(llm, [[5, 9, 12]], PLAIN)[0]
    good = engine.add_request([5, 9, 12], PLAIN)
    engine.step()
    with pytest.raises(ValueError, match=named):
        engine.add_request([7, 8], SamplingParams(guided_decoding=guided))
    while not good.finished:
        engine.step()
    assert good.completions[0].token_ids == alone and good.error is None
    assert not engine.has_unfinished() and not engine.requests
