"""LMDeploy's per-call arguments on `pipeline` and AsyncEngine (seed 000/002's call tables): a call's own
`chat_template_config`; the legacy sampling arguments' defaults (top_k 40, top_p 0.8, temperature 0.8,
request_output_len 512) when a call passes some of them without a gen_config; `adapter_name` (None only:
no LoRA); `pipeline(instance_num=...)` accepted."""
import pytest

from conftest import write_tiny_llama
from lmjax import ChatTemplateConfig, GenerationConfig, pipeline
from lmjax.api.lmdeploy_params import with_legacy

MARKED = ChatTemplateConfig(model_name="marked", user="t9 ", eoh=" t8", assistant=" t7")  # 3 more tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def pipe(tiny):
    return pipeline(tiny, instance_num=32)  # LMDeploy's instance count: accepted


def test_a_call_takes_its_own_chat_template(pipe):
    one = GenerationConfig(max_new_tokens=1)
    plain = pipe("t5 t6", gen_config=one)
    marked = pipe("t5 t6", gen_config=one, chat_template_config=MARKED)
    streamed = list(pipe.stream_infer(["t5 t6"], gen_config=one, chat_template_config=MARKED))
    assert marked.input_token_len == plain.input_token_len + 3 == streamed[-1].input_token_len
    assert pipe("t5 t6", gen_config=one).input_token_len == plain.input_token_len  # the pipeline's own is kept


def test_legacy_arguments_without_gen_config_sample_with_their_own_defaults(pipe):
    assert with_legacy(None, {"temperature": 0.7}) == GenerationConfig(max_new_tokens=512, top_k=40, top_p=0.8,
                                                                       temperature=0.7)
    assert with_legacy(None, {}) == GenerationConfig()  # no legacy argument: GenerationConfig()'s (greedy)
    given = GenerationConfig(max_new_tokens=3)
    assert with_legacy(given, {"top_k": 5}) == GenerationConfig(max_new_tokens=3, top_k=5)
    sampled = {tuple(pipe("t5 t6", request_output_len=12, temperature=1.0).token_ids) for _ in range(4)}
    greedy = {tuple(pipe("t5 t6", gen_config=GenerationConfig(max_new_tokens=12)).token_ids) for _ in range(2)}
    assert len(sampled) > 1 and len(greedy) == 1


def test_adapter_name_must_be_none(pipe):
    assert pipe("t5", gen_config=GenerationConfig(max_new_tokens=1), adapter_name=None).generate_token_len == 1
    with pytest.raises(NotImplementedError, match="adapter_name='lora1'"):
        pipe("t5", adapter_name="lora1")


def test_async_engine_batches_take_a_template_and_legacy_defaults(tiny):
    from lmjax.api.async_engine import AsyncEngine

    with AsyncEngine(tiny) as engine:
        one = GenerationConfig(max_new_tokens=1)
        plain = engine.batch_infer("t5 t6", gen_config=one)
        marked = engine.batch_infer("t5 t6", gen_config=one, chat_template_config=MARKED)
        assert marked.input_token_len == plain.input_token_len + 3
        assert engine.sampling_params(None, top_p=0.5).top_k == 40  # the legacy defaults, then top_p's own
        with pytest.raises(NotImplementedError, match="adapter_name='x'"):
            engine.batch_infer("t5", adapter_name="x")
