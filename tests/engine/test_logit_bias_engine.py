"""logit_bias in the engine and the OpenAI server, on one tiny random Llama engine (word-level vocabulary
t0..t255, t3 ends a sequence) behind both: a +100 bias forces a token and a -100 one bans it; unbiased rows
of the same batch keep the tokens they get alone; biased rows ride in multi-step decode calls (a fixed
per-request input); an id outside the vocabulary is a ValueError naming it at submission; the server takes
OpenAI's {"token id": bias} and answers a bad key or value with a 400 naming it. (Sampled rows under a bias:
tests/layers/test_sampler_logit_bias.py; here each new sampling flag set would cost a compilation.)"""
import jax
import numpy as np
import openai
import pytest

from conftest import write_tiny_llama
from lmjax import SamplingParams
from lmjax.engine.followers import _follower_sampling_templates, step_kind
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    engine = AsyncEngine(path, model_name="tiny", backend_config=TurbomindEngineConfig(session_len=256,
                                                                                        cache_block_seq_len=16))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from lmjax.serve.openai_server import create_app

    with TestClient(create_app(engine)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)


def _tokens(engine, prompts, params) -> list[list[int]]:
    return [r.token_ids for r in engine.batch_infer(prompts, gen_config=params, do_preprocess=False)]


def test_bias_forces_and_bans_tokens_inside_multi_step_decode(engine):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = _tokens(engine, ["t5 t9 t12 t30"], [plain])[0]
    loops = engine.engine.num_decode_loops
    forced = SamplingParams(temperature=0, max_tokens=20, logit_bias={42: 100.0})
    banned = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={t: -100.0 for t in alone})
    prompts = ["t5 t9 t12 t30", "t7 t8", "t5 t9 t12 t30"]
    single = _tokens(engine, prompts, [plain, forced, banned])  # single steps until its variant compiles
    engine.engine.runner.wait_for_compiles()
    outs = _tokens(engine, prompts, [plain, forced, banned])
    assert outs == single
    assert outs[0] == alone  # the unbiased row of the mixed batch: the tokens it gets alone
    assert outs[1] == [42] * 20
    assert len(outs[2]) == 20 and not set(outs[2]) & set(alone)
    assert engine.engine.num_decode_loops >= loops + 2  # biased rows decode K steps per call, as the others


def test_out_of_vocabulary_ids_are_named_at_submission(engine):
    for bad in (256, -1):
        with pytest.raises(ValueError, match=rf"logit_bias token ids \[{bad}\] are outside the vocabulary \[0, 256\)"):
            engine.engine.validate_request([5], SamplingParams(logit_bias={5: 1.0, bad: 2.0}))


def test_each_optional_input_combination_is_its_own_follower_step_kind():
    """tp followers (ModelRunner.follow) receive a step by its kind's pytree structure."""
    templates = _follower_sampling_templates()
    assert sorted(templates) == [1, 2, 3, 4]  # plain, mask, bias, mask + bias
    assert len({jax.tree.structure(t) for t in templates.values()}) == 4
    biased = SamplingRow(SamplingParams(temperature=0, logit_bias={1: 2.0}), 0, allowed_W=np.ones(2, np.uint32))
    meta, _ = build_sampling_metadata([biased], pad_to=4)
    assert jax.tree.structure(meta) == jax.tree.structure(templates[step_kind(meta)])


def test_server_takes_openai_logit_bias(client):
    # temperature 0: the steps the engine test compiled serve these too
    out = client.completions.create(model="tiny", prompt=[5, 9, 12], max_tokens=4, temperature=0,
                                    logit_bias={"42": 100})
    assert out.choices[0].text.split() == ["t42"] * 4, out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5 t6"}], max_tokens=3,
                                          temperature=0, logit_bias={"44": 100})
    assert chat.choices[0].message.content.split() == ["t44"] * 3, chat.choices[0].message.content


@pytest.mark.parametrize("bias, named", [
    ({"abc": 5}, "logit_bias key 'abc' is not a token id"),
    ({"4.5": 5}, "logit_bias key '4.5' is not a token id"),
    ({"42": 101}, r"logit_bias\['42'\]=101 must be a number in \[-100, 100\]"),
    ({"42": -100.5}, r"logit_bias\['42'\]=-100.5 must be"),
    ({"42": "5"}, r"logit_bias\['42'\]='5' must be"),
    ({"256": 5}, r"logit_bias token ids \[256\] are outside the vocabulary"),
])
def test_server_names_a_bad_logit_bias(client, bias, named):
    with pytest.raises(openai.BadRequestError, match=named):
        client.completions.create(model="tiny", prompt=[5, 9], max_tokens=2, logit_bias=bias)
    with pytest.raises(openai.BadRequestError, match=named):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5"}], max_tokens=2,
                                       logit_bias=bias)
