"""LMDeploy facades as lagent drives them (probe 24):
- keyword settings: LMDeploy's generate / __call__ / batch_infer / stream_infer take **kwargs, and lagent's
  AsyncLMDeployPipeline forwards its per-call overrides there (`generate('hi', max_new_tokens=8)`) as well as
  into its gen_config; lmjax refused them (TypeError). GenerationConfig's field names now override the
  gen_config, as LMDeploy's old argument names do; other names are still a TypeError;
- a stop word that is a special token (InternLM2's `<|action_end|>`) stops generation, as LMDeploy turns stop
  words into ids: with skip_special_tokens on such a token adds no text, so the text match never saw it;
- AsyncEngine.generate's `step` (LMDeploy's KV offset) was accepted and ignored: a later turn with step=k now
  continues after the session's first k tokens.
Tiny random Llama (word-level vocabulary t0..t255)."""
import asyncio
import shutil

import pytest

from conftest import write_tiny_llama
from lmjax import ChatTemplateConfig, GenerationConfig, TurbomindEngineConfig, pipeline
from lmjax.api.async_engine import AsyncEngine
from lmjax.messages import Response

CFG = dict(session_len=256, cache_max_entry_count=0.05)
GREEDY = dict(top_k=1, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def pipe(path):
    return pipeline(path, backend_config=TurbomindEngineConfig(**CFG))


def _lagent_async_generate(pipe, text, **kwargs):
    """lagent's AsyncLMDeployPipeline.generate, its body unchanged: a gen_config from its defaults updated by
    the call's kwargs, and the same kwargs forwarded to generate."""
    gen_params = dict(max_new_tokens=512, top_p=0.8, top_k=40, temperature=0.8, repetition_penalty=1.0,
                      stop_words=None)
    gen_params.update(kwargs)
    gen_config = GenerationConfig(skip_special_tokens=False, **gen_params)

    async def inner(uid):
        resp = Response('', 0, 0, uid)
        async for out in pipe.generate(text, uid, gen_config, stream_response=True, sequence_start=True,
                                       sequence_end=True, do_preprocess=None, **kwargs):
            resp.text += out.response
            resp.generate_token_len, resp.finish_reason = out.generate_token_len, out.finish_reason
        return resp
    return asyncio.run(inner(0))


def test_lagent_async_pipeline_per_call_overrides(pipe):
    resp = _lagent_async_generate(pipe, "t5 t6", max_new_tokens=3, temperature=0, **GREEDY)
    assert resp.generate_token_len == 3 and resp.finish_reason == "length"


def test_generation_config_names_as_keywords_override_the_gen_config(pipe):
    g = GenerationConfig(max_new_tokens=6, **GREEDY)
    assert pipe.batch_infer(["t5 t6"], gen_config=g, do_preprocess=False, max_new_tokens=2)[0].generate_token_len == 2
    assert pipe("t5 t6", gen_config=g, do_preprocess=False, max_new_tokens=4).generate_token_len == 4
    pieces = list(pipe.stream_infer("t5 t6", gen_config=g, do_preprocess=False, max_new_tokens=3))
    assert pieces[-1].generate_token_len == 3

    async def run():
        return [o async for o in pipe.generate("t5 t6", 7, g, do_preprocess=False, max_new_tokens=2, do_sample=False)]
    assert asyncio.run(run())[-1].generate_token_len == 2
    with pytest.raises(TypeError, match="not_a_setting"):
        pipe("t5", gen_config=g, not_a_setting=1)


@pytest.fixture(scope="module")
def special(path, pipe, tmp_path_factory):
    """A copy of the model whose tokenizer marks a token of the greedy reply to 't7' special (weights as
    they are, so the greedy tokens stay): (path, its id, its word, the reply's ids)."""
    from transformers import AutoTokenizer

    base = pipe("t7", gen_config=GenerationConfig(max_new_tokens=6, **GREEDY), do_preprocess=False).token_ids
    i = next(i for i in range(1, 5) if base[i] not in base[:i] and not any(
        f"t{t}".startswith(f"t{base[i]}") for t in base if t != base[i]))
    out = str(tmp_path_factory.mktemp("special"))
    shutil.copytree(path, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": [f"t{base[i]}"]})
    tok.save_pretrained(out)
    return out, base[i], f"t{base[i]}", base


@pytest.mark.parametrize("where", ["gen_config", "chat_template"])
def test_a_special_token_stop_word_stops_generation(special, where):
    path, tid, word, base = special
    template = ChatTemplateConfig(model_name="plain", user="", eoh="", assistant="", stop_words=[word]) \
        if where == "chat_template" else None
    pipe = pipeline(path, backend_config=TurbomindEngineConfig(**CFG), chat_template_config=template)
    assert word in pipe.tokenizer.all_special_tokens
    g = GenerationConfig(max_new_tokens=6, stop_words=[word] if template is None else None, **GREEDY)
    r = pipe("t7", gen_config=g, do_preprocess=template is not None)
    cut = base.index(tid)
    assert r.finish_reason == "stop" and r.token_ids == base[:cut], (r.token_ids, base)  # (LMDeploy: stop id left out)
    assert word not in r.text


def test_step_continues_after_the_sessions_first_k_tokens(path):
    engine = AsyncEngine(path, backend_config=TurbomindEngineConfig(**CFG))
    g = GenerationConfig(max_new_tokens=4, **GREEDY)

    async def turn(ids, sid, **kw):
        return [o async for o in engine.generate(None, sid, g, input_ids=ids, sequence_end=False, **kw)][-1]

    async def main():
        first = await turn([5, 6, 7, 8], 11, sequence_start=True)
        assert engine.id2step[11] == 4 + first.generate_token_len
        rewound = await turn([9], 11, sequence_start=False, step=2)
        fresh = await turn([5, 6, 9], 12, sequence_start=True)
        assert rewound.history_token_len == 2 and rewound.token_ids == fresh.token_ids
        assert engine.id2step[11] == 3 + rewound.generate_token_len
        with pytest.raises(ValueError, match="step=99"):
            await turn([9], 11, sequence_start=False, step=99)
    try:
        asyncio.run(main())
    finally:
        engine.close()
