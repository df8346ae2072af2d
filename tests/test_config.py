"""Config dataclasses: defaults from the API docs, validation messages, lowering onto EngineConfig."""
import dataclasses

import jax.numpy as jnp
import pytest
import torch

from lmjax.config import ENGINE_UNSUPPORTED, ChatTemplateConfig, EngineConfig, GenerationConfig, SamplingParams
from lmjax.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig


def test_generation_config_seed_defaults():
    g = GenerationConfig()
    assert (g.n, g.max_new_tokens, g.top_p, g.top_k, g.temperature) == (1, 512, 1.0, 1, 0.8)
    assert (g.repetition_penalty, g.ignore_eos, g.random_seed) == (1.0, False, None)
    assert g.stop_words is None and g.bad_words is None and g.logprobs is None


def test_sampling_params_vllm_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.n) == (1.0, 1.0, 0, 0.0, 16, 1)
    assert not p.is_greedy and not p.uses_penalties
    assert SamplingParams(top_k=-1).top_k == -1


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(top_k=-2), "top_k must be an int >= -1, got -2"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(n=0), "n must be an int >= 1, got 0"),
    (dict(max_tokens=0), "max_tokens must be None or an int >= 1, got 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0"),
    (dict(logprobs=-2), "logprobs must be None, -1 (the whole vocabulary) or an int >= 0, got -2"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens=5 must not exceed max_tokens=4"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must hold int values"),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (dict(prompt_logprobs="a"), "prompt_logprobs must be None, -1 (the whole vocabulary) or an int >= 0, got 'a'"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None, -1 (the model's limit) or an int >= 1, got 0"),
    (dict(stop=["\n"], detokenize=False), "stop strings are only supported when detokenize is True"),
])
def test_sampling_params_validation_names_value(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("make, named", [
    (lambda: SamplingParams(best_of=3), "best_of=3"),
])
def test_fields_kept_for_compatibility_pass_at_defaults_only(make, named):
    """vLLM's / LMDeploy's fields lmjax does not implement: code that passes their defaults runs as is."""
    assert SamplingParams(best_of=2, n=2, detokenize=True, logits_processors=None, allowed_token_ids=None).n == 2
    assert GenerationConfig(response_format=None, logits_processors=None, output_logits=None).n == 1
    with pytest.raises(NotImplementedError, match=named):
        make()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=5.5), "max_new_tokens must be None or an int >= 1, got 5.5"),
    (dict(max_new_tokens=5, min_new_tokens=10), "min_new_tokens=10 must not exceed max_new_tokens=5"),
    (dict(top_p="0.9"), "top_p must be a number, got '0.9'"),
])
def test_generation_config_validation_names_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GenerationConfig(**kwargs)


def test_unknown_field_lists_names_and_suggests():
    with pytest.raises(TypeError) as e:
        SamplingParams(max_token=3, foo=1)
    msg = str(e.value)
    assert "SamplingParams" in msg and "'max_token'" in msg and "'foo'" in msg
    assert "did you mean 'max_tokens'" in msg
    with pytest.raises(TypeError, match="max_new_token"):
        GenerationConfig(max_new_token=3)


def test_stop_normalized_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=7).stop_token_ids == [7]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_dataclasses_replace_validates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, top_p=0.9).top_p == 0.9
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0.0)


def test_generation_config_top_k_1_is_greedy():
    p = GenerationConfig().to_sampling_params()
    assert p.temperature == 0.0 and p.is_greedy and p.max_tokens == 512


def test_generation_config_maps_every_field():
    g = GenerationConfig(n=2, max_new_tokens=7, top_p=0.9, top_k=40, min_p=0.05, temperature=0.7,
                         repetition_penalty=1.1, ignore_eos=True, random_seed=3, stop_words=["x"],
                         bad_words=["y"], stop_token_ids=[5], bad_token_ids=[6], min_new_tokens=2,
                         skip_special_tokens=False, spaces_between_special_tokens=False,
                         logprobs=4, include_stop_str_in_output=True)
    p = g.to_sampling_params()
    assert (p.n, p.max_tokens, p.top_p, p.top_k, p.min_p, p.temperature) == (2, 7, 0.9, 40, 0.05, 0.7)
    assert (p.repetition_penalty, p.ignore_eos, p.seed, p.stop, p.bad_words) == (1.1, True, 3, ["x"], ["y"])
    assert (p.stop_token_ids, p.bad_token_ids, p.min_tokens, p.logprobs) == ([5], [6], 2, 4)
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
    assert p.include_stop_str_in_output


def test_generation_config_temperature_zero_is_greedy():
    assert GenerationConfig(top_k=40, temperature=0.0).to_sampling_params().is_greedy


@pytest.mark.parametrize("kwargs, greedy, top_k", [
    (dict(), True, 0),  # the seeds' rule: top_k=1 (its default) is greedy
    (dict(top_k=40), False, 40),
    (dict(do_sample=False, top_k=40, top_p=0.5, temperature=1.2), True, 0),  # LMDeploy 0.6: greedy whatever they say
    (dict(do_sample=True), False, 50),  # LMDeploy 0.6's default top_k when sampling
    (dict(do_sample=True, top_k=0), False, 0),  # given explicitly: kept
    (dict(do_sample=True, top_k=1), True, 0),  # top-1 sampling is greedy
    (dict(do_sample=True, temperature=0.0), True, 0),
])
def test_generation_config_do_sample(kwargs, greedy, top_k):
    p = GenerationConfig(**kwargs).to_sampling_params()
    assert (p.is_greedy, p.top_k) == (greedy, top_k)


def test_generation_config_do_sample_survives_replace_and_keeps_repetition_penalty():
    g = dataclasses.replace(GenerationConfig(repetition_penalty=1.3), do_sample=True)
    assert g.top_k == 50  # top_k was never given: replace carries its default mark
    greedy = dataclasses.replace(g, do_sample=False).to_sampling_params()
    assert greedy.is_greedy and greedy.repetition_penalty == 1.3  # LMDeploy drops it here; lmjax does not
    assert GenerationConfig().top_k == 1 and repr(GenerationConfig()).count("top_k=1,") == 1
    with pytest.raises(ValueError, match="do_sample must be None, True or False, got 'yes'"):
        GenerationConfig(do_sample="yes")


def test_engine_config_validation():
    assert EngineConfig().max_logprobs == 20  # vLLM's default
    with pytest.raises(ValueError, match="max_logprobs must be an int >= -1 .* got -2"):
        EngineConfig(max_logprobs=-2)
    with pytest.raises(ValueError, match="dtype must be one of .* got 'fp8'"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="dtype must be one of .* got torch.int8"):
        EngineConfig(dtype=torch.int8)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="cache_max_entry_count .* got 1.5"):
        EngineConfig(cache_max_entry_count=1.5)
    assert EngineConfig(quant_policy=8).quant_policy == 8  # KV int8 (int4: 4), see tests/convert/test_kv_quant.py
    with pytest.raises(ValueError, match="quant_policy must be the int 0, 4 or 8, got 3"):
        EngineConfig(quant_policy=3)


@pytest.mark.parametrize("dtype, name", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                         (torch.float16, "float16"), (jnp.bfloat16, "bfloat16"),
                                         ("HALF", "float16"), ("BFloat16", "bfloat16")])
def test_engine_config_takes_vllm_dtype_spellings(dtype, name):
    """vLLM's --dtype takes half / float and LLM(dtype=) a torch dtype: LLM(model, dtype="half") was refused."""
    assert EngineConfig(dtype=dtype).dtype == name
    assert TurbomindEngineConfig(dtype=dtype).dtype == name


def test_engine_config_num_blocks():
    assert EngineConfig(num_gpu_blocks=10).num_blocks(10**9, 100) == 10
    assert EngineConfig(cache_max_entry_count=300).num_blocks(10**9, 100) == 300
    assert EngineConfig(cache_max_entry_count=0.5).num_blocks(1000, 100) == 5


def test_turbomind_defaults_lower():
    e = TurbomindEngineConfig().to_engine_config()
    assert e == EngineConfig(block_size=128, seed=None)  # (LMDeploy: unseeded requests vary)


def test_turbomind_maps_fields():
    t = TurbomindEngineConfig(model_name="x", tp=2, session_len=1024, max_batch_size=8,
                              cache_max_entry_count=0.3, cache_block_seq_len=32, enable_prefix_caching=True,
                              rope_scaling_factor=2.0, use_dynamic_ntk=True, max_prefill_token_num=512,
                              dtype="bfloat16", model_format="hf")
    e = t.to_engine_config()
    assert (e.tp, e.session_len, e.max_batch_size, e.cache_max_entry_count) == (2, 1024, 8, 0.3)
    assert (e.block_size, e.enable_prefix_caching, e.rope_scaling_factor) == (32, True, 2.0)
    assert (e.use_dynamic_ntk, e.max_prefill_token_num, e.dtype) == (True, 512, "bfloat16")
    assert TurbomindEngineConfig(use_logn_attn=True).to_engine_config().use_logn_attn
    assert TurbomindEngineConfig(max_context_token_num=2048).to_engine_config().max_prefill_token_num == 2048


@pytest.mark.parametrize("cfg, field", [
    (TurbomindEngineConfig(model_format="gptq"), "model_format"),
    (TurbomindEngineConfig(group_size=64), "group_size"),
    (TurbomindEngineConfig(download_dir="/tmp"), "download_dir"),
    (PytorchEngineConfig(adapters={"a": "/p"}), "adapters"),
    (PytorchEngineConfig(device_type="ascend"), "device_type"),
    (PytorchEngineConfig(dp=2), "dp"),
])
def test_unsupported_field_raises_naming_it(cfg, field):
    with pytest.raises(NotImplementedError, match=field):
        cfg.to_engine_config()


def test_pytorch_maps_fields():
    e = PytorchEngineConfig(tp=2, session_len=2024, max_batch_size=4, block_size=16, num_gpu_blocks=100,
                            enable_prefix_caching=True, dtype="float16").to_engine_config()
    assert (e.tp, e.session_len, e.max_batch_size, e.block_size) == (2, 2024, 4, 16)
    assert (e.num_gpu_blocks, e.enable_prefix_caching, e.dtype) == (100, True, "float16")
    assert PytorchEngineConfig().to_engine_config() == EngineConfig(max_prefill_token_num=4096, seed=None)


@pytest.mark.parametrize("cls", [TurbomindEngineConfig, PytorchEngineConfig])
def test_every_nondefault_field_is_mapped_or_refused(cls):
    """No LMDeploy field may be silently dropped: each one changes EngineConfig or raises (TUNING_ONLY
    fields are accepted with a logged warning instead: tests/api/test_parity_small.py)."""
    # model_format is read from the checkpoint itself ('awq' checkpoints say so in their config.json)
    frontend = {"model_name", "max_context_token_num", "model_format", *cls.TUNING_ONLY}
    base = cls().to_engine_config()
    for f in dataclasses.fields(cls):
        if f.name in frontend:
            continue
        value = _other_value(f.name, f.default)
        try:
            lowered = cls(**{f.name: value}).to_engine_config()
        except (NotImplementedError, ValueError):
            continue
        assert lowered != base, f"{cls.__name__}.{f.name}={value!r} was silently ignored"


def _other_value(name, default):
    special = {"dtype": "float32", "model_format": "awq", "eviction_type": "copy", "device_type": "cpu",
               "quant_policy": 4, "communicator": "nccl2", "session_len": 100}
    if name in special:
        return special[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return 0.25 if default != 0.25 else 0.3
    if isinstance(default, int):
        return default + 2 if default >= 0 else 4
    return {"x": "y"} if name in ("adapters", "custom_module_map") else "x" if default is None else default + "x"


class _FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_chat_template_uses_tokenizer_template_by_default():
    cfg = ChatTemplateConfig(model_name="smollm2")
    assert cfg.messages2prompt("hi", _FakeTokenizer()) == "user:hi|assistant:"
    assert cfg.messages2prompt("hi", tokenizer=None) == "hi"  # no template anywhere: LMDeploy's base one


def test_chat_template_role_markers():
    cfg = ChatTemplateConfig(model_name="custom", system="<s>", meta_instruction="Be nice.", eosys="</s>\n",
                             user="<u>", eoh="</u>\n", assistant="<a>", eoa="</a>", separator="\n")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "你好"}]
    assert cfg.messages2prompt(msgs) == "<s>Be nice.</s>\n<u>hi</u>\n<a>yo</a>\n<u>你好</u>\n<a>"
    sys_first = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert cfg.messages2prompt(sys_first) == "<s>S</s>\n<u>q</u>\n<a>"
    assert ChatTemplateConfig(model_name="x", capability="completion").messages2prompt("raw") == "raw"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}]
    # a last assistant message starts the reply (LMDeploy): its (empty) content is left open
    assert cfg.messages2prompt(parts) == "<s>Be nice.</s>\n<u>a\nb</u>\n<a>"
    assert cfg.messages2prompt(parts, add_generation_prompt=True) == "<s>Be nice.</s>\n<u>a\nb</u>\n<a></a>\n<a>"
    with pytest.raises(ValueError, match=r"messages\[0\]: content parts of type \['input_audio'\]"):
        cfg.messages2prompt([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_chat_template_with_real_tokenizer(smollm2_tokenizer):
    prompt = ChatTemplateConfig(model_name="smollm2").messages2prompt("你好", smollm2_tokenizer)
    assert prompt.endswith("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    import os

    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))


def test_a_model_without_a_chat_template_gets_lmdeploys_base_template(caplog):
    """No role markers and no tokenizer template (a base model): the text as is, as LMDeploy's "base"
    template, with one warning (was a ValueError, so `lmjax chat` on a base model failed every turn)."""
    from types import SimpleNamespace

    from lmjax.config import ChatTemplateConfig

    base = SimpleNamespace(chat_template=None)
    with caplog.at_level("WARNING", logger="lmjax"):
        assert ChatTemplateConfig(model_name="base").messages2prompt("Once upon a time", base) == "Once upon a time"
        turns = [{"role": "user", "content": "a "}, {"role": "assistant", "content": "b "},
                 {"role": "user", "content": "c"}]
        assert ChatTemplateConfig(model_name="base").messages2prompt(turns, base) == "a b c"
    assert sum("no chat template" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("field,value", [("quant_policy", 8.0), ("quant_policy", "8"), ("quant_policy", True),
                                         ("session_len", 64.0), ("num_gpu_blocks", 16.0)])
def test_engine_config_integer_fields_refuse_other_types_naming_them(field, value):
    """Before: 8.0 / 64.0 / 16.0 passed (8.0 in (0, 4, 8)) and the engine failed later with a TypeError naming
    no field; "8" was refused as "got 8", which read as if 8 itself were wrong."""
    with pytest.raises(ValueError, match=f"{field} must be .*got {value!r}"):
        EngineConfig(**{field: value})


def test_engine_sizes_refuse_bools():
    """True is an int to Python; LLM(tensor_parallel_size=True) ran silently at tp=1 (probe 26)."""
    from lmjax.config import EngineConfig

    for name in ("tp", "max_batch_size", "block_size", "max_prefill_token_num", "num_scheduler_steps"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got True"):
            EngineConfig(**{name: True})
