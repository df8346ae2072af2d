"""A request whose bans, allowed tokens or logits processors leave no token with a finite logit has nothing
to sample: the sampler marks its row NO_TOKEN and the engine ends that request with "error" naming why.
Before: the argmax over an all -inf row said token 0, which the request emitted as if sampled. Tiny random
Llama (word-level vocabulary t0..t255, t3 ends a sequence)."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.layers.sampler import NO_TOKEN, SamplingRow, build_sampling_metadata, sample


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLM(path, max_model_len=128, block_size=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_marks_only_the_row_with_nothing_left(temperature):
    V = 64
    params = SamplingParams(temperature=temperature, seed=1)
    rows = [SamplingRow(params, seed=1), SamplingRow(params, seed=1, banned_ids=list(range(V)))]
    meta, flags = build_sampling_metadata(rows, pad_to=4)
    logits_BV = jnp.asarray(np.random.default_rng(0).normal(size=(4, V)), jnp.float32)
    token_ids = np.asarray(sample(logits_BV, meta, **flags._asdict()).token_ids_B)
    assert token_ids[1] == NO_TOKEN
    assert 0 <= token_ids[0] < V and token_ids[0] != NO_TOKEN
    if temperature == 0:
        assert token_ids[0] == int(np.argmax(np.asarray(logits_BV[0])))


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **kw})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_banning_the_only_allowed_token_is_an_error(llm, temperature):
    """allowed_token_ids=[eos] while min_tokens bans eos: nothing is left for the first token."""
    alone = llm.generate([[5, 9, 12]], _params(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    outs = llm.generate([[5, 9, 12], [7, 8]],
                        [_params(ignore_eos=True),
                         _params(temperature=temperature, seed=3, allowed_token_ids=[3], min_tokens=2)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.token_ids and outs[0].outputs[0].finish_reason == "length"
    stuck = outs[1].outputs[0]
    assert stuck.finish_reason == "error" and list(stuck.token_ids) == [] and stuck.text == ""
    assert not llm.llm_engine.has_unfinished()


def test_a_processor_and_a_ban_that_leave_nothing_end_the_request_after_its_good_tokens(llm):
    """The processor keeps only t7 from the third token on and t7 is banned: two tokens, then "error"."""
    def only_7_late(output_ids, logits):
        if len(output_ids) >= 2:
            logits[np.arange(logits.shape[0]) != 7] = -np.inf
        return logits
    free = llm.generate([[5, 9]], _params(ignore_eos=True, bad_token_ids=[7]), use_tqdm=False)[0].outputs[0]
    out = llm.generate([[5, 9]], _params(ignore_eos=True, bad_token_ids=[7], logits_processors=[only_7_late]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and list(out.token_ids) == list(free.token_ids[:2])


def test_the_engine_names_the_cause(llm):
    engine = llm.llm_engine
    req = engine.add_request([5, 9, 12], _params(allowed_token_ids=[3], min_tokens=1))
    for _ in range(50):
        if req.finished:
            break
        engine.step()
    assert req.completions[0].finish_reason == "error"
    assert "nothing could be sampled for output token 0" in req.error, req.error
