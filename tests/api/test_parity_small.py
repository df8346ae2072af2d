"""Small vLLM / LMDeploy API-parity points: LLM.generate's prompt_adapter_request / guided_options_request,
LLM's tuning-only arguments (accepted, logged once as having no effect), SamplingParams' [] stop defaults,
clone() and all_stop_token_ids, RequestOutput / CompletionOutput's vLLM fields, LMDeploy Response's logits /
last_hidden_state, and the LMDeploy engine configs' tuning-only fields."""
import dataclasses
import enum
import logging
import time
import types

import pytest

from conftest import write_tiny_llama
from lmjax import (LLM, GuidedDecodingParams, PytorchEngineConfig, SamplingParams, TurbomindEngineConfig,
                   RequestOutput, Response)
from lmjax.api.llm import _check_vllm_only
from lmjax.api.outputs import CompletionOutput

REGEX = "(t4|t5){2,5}t6"  # the tiny model's word-level vocabulary: "t4" is token 4 (tests/engine/test_guided_engine)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLM(path, max_model_len=256, block_size=16, swap_space=0, disable_log_stats=True)


GREEDY = SamplingParams(temperature=0, max_tokens=12)


# 1. LLM.generate(prompt_adapter_request=, guided_options_request=) (seed 004's signature)

def test_generate_takes_vllms_adapter_and_guided_keywords(llm):
    out = llm.generate([[5, 9, 12]], GREEDY, use_tqdm=False, prompt_adapter_request=None,
                       guided_options_request=None)
    assert len(out[0].outputs[0].token_ids) == 12
    with pytest.raises(NotImplementedError, match="prompt_adapter_request"):
        llm.generate([[5, 9, 12]], GREEDY, use_tqdm=False, prompt_adapter_request=object())


def test_guided_options_request_guides_every_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate([[5, 9, 12, 30], [7, 8, 9]], params, use_tqdm=False,
                        guided_options_request={"guided_regex": REGEX})
    for out in outs:
        ids = out.outputs[0].token_ids
        assert ids[-2:] == [6, 3] and set(ids[:-2]) <= {4, 5} and out.outputs[0].finish_reason == "stop"
    assert params.guided_decoding is None  # the caller's SamplingParams are left as they were
    request = types.SimpleNamespace(guided_choice=["t7t8", "t9"])  # vLLM's GuidedDecodingRequest-like object
    out = llm.generate([[40, 41]], params, use_tqdm=False, guided_options_request=request)[0]
    assert out.outputs[0].token_ids in ([7, 8, 3], [9, 3])
    out = llm.generate([[40, 41]], params, use_tqdm=False, guided_options_request=GuidedDecodingParams(choice=["t9"]))
    assert out[0].outputs[0].token_ids == [9, 3]


def test_guided_options_request_errors_name_the_problem(llm):
    guided = SamplingParams(guided_decoding=GuidedDecodingParams(regex="t4"))
    with pytest.raises(ValueError, match="not both"):
        llm.generate([[5]], guided, use_tqdm=False, guided_options_request={"guided_regex": REGEX})
    with pytest.raises(ValueError, match="Rule 'a' not found"):  # a grammar is a guide: compiled at submission
        llm.generate([[5]], GREEDY, use_tqdm=False, guided_options_request={"guided_grammar": "root ::= a"})
    with pytest.raises(TypeError, match="guided_regexp"):
        llm.generate([[5]], GREEDY, use_tqdm=False, guided_options_request={"guided_regexp": REGEX})
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate([[5]], GREEDY, use_tqdm=False,
                     guided_options_request={"guided_regex": REGEX, "guided_choice": ["a"]})
    assert not llm.llm_engine.has_unfinished()


# 2. LLM's vLLM-only arguments: tuning ones accepted (warned once), the others still refused

@pytest.mark.parametrize("name, value", [("swap_space", 1), ("swap_space", 2.5), ("disable_custom_all_reduce", True),
                                         ("disable_async_output_proc", True), ("max_seq_len_to_capture", 1234),
                                         ("max_context_len_to_capture", 4321), ("disable_log_stats", False)])
def test_tuning_only_llm_arguments_are_accepted_with_a_warning(name, value, caplog):
    # (values unused elsewhere in these tests: the warning is logged once per value and process)
    with caplog.at_level(logging.WARNING, logger="lmjax"):
        _check_vllm_only({name: value})
    assert f"LLM({name}={value!r}) has no effect" in caplog.text


def test_llm_default_tuning_values_pass_quietly(caplog):
    with caplog.at_level(logging.WARNING, logger="lmjax"):
        _check_vllm_only({"swap_space": 4, "disable_log_stats": True, "max_seq_len_to_capture": 8192})
    assert "no effect" not in caplog.text


@pytest.mark.parametrize("kwargs, error, match", [
    ({"swap_space": -1}, ValueError, "swap_space"),
    ({"tokenizer_mode": "slow"}, NotImplementedError, r"LLM\(tokenizer_mode='slow'\)"),
    ({"cpu_offload_gb": 4}, NotImplementedError, "cpu_offload_gb"),
    ({"skip_tokenizer_init": True}, NotImplementedError, "skip_tokenizer_init"),
    ({"swap_spaces": 4}, TypeError, "swap_spaces"),
])
def test_other_vllm_only_arguments_still_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM("no/such-model", **kwargs)  # checked before anything loads


# 3. LMDeploy's Response

def test_response_has_lmdeploys_fields_and_leading_order():
    names = [f.name for f in dataclasses.fields(Response)]
    assert names[:9] == ["text", "generate_token_len", "input_token_len", "finish_reason", "token_ids", "logprobs",
                         "logits", "last_hidden_state", "index"]  # LMDeploy's order
    r = Response("", 0, 0, "stop")
    assert (r.finish_reason, r.logits, r.last_hidden_state, r.index, r.session_id) == ("stop", None, None, 0, None)
    assert Response("hi", 1, 2, session_id=3, index=1).session_id == 3


# 4. SamplingParams: [] stop defaults, clone(), all_stop_token_ids

def test_sampling_params_stop_fields_default_to_empty_lists():
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    assert SamplingParams().stop is not p.stop  # a fresh list each


def test_sampling_params_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[7], logit_bias={1: 2.0}, guided_decoding={"choice": ["a", "b"]})
    c = p.clone()
    assert c == p and c is not p and c.stop is not p.stop and c.guided_decoding is not p.guided_decoding
    c.stop.append("y")
    assert p.stop == ["x"]


def test_sampling_params_clone_shares_no_mutable_field():
    """clone copies field by field (a deepcopy of 100k allowed ids cost ~20 ms a request): a field added
    later that holds a list, dict or object must be copied too."""
    def processor(ids, logits):
        return logits
    p = SamplingParams(stop=["x"], stop_token_ids=[7], bad_words=["b"], bad_token_ids=[8], allowed_token_ids=[1, 2],
                       logit_bias={1: 2.0}, guided_decoding={"choice": ["a"]}, logits_processors=[processor],
                       extra_args={"k": [1]})
    c = p.clone()
    assert c == p
    for f in dataclasses.fields(SamplingParams):
        value = getattr(p, f.name)
        if value is not None and not isinstance(value, (bool, int, float, str, enum.Enum)):
            assert getattr(c, f.name) is not value, f"clone shares SamplingParams.{f.name}"
    assert c.logits_processors[0] is processor  # shared, as vLLM's clone does


def test_all_stop_token_ids():
    assert SamplingParams().all_stop_token_ids == set()
    assert SamplingParams(stop_token_ids=[7, 9, 7], ignore_eos=True).all_stop_token_ids == {7, 9}


def test_default_stop_lists_generate_as_before(llm):
    none = SamplingParams(temperature=0, max_tokens=8, stop=None, stop_token_ids=None)
    assert (llm.generate([[5, 6]], none, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids)


# 5. RequestOutput / CompletionOutput's vLLM fields

def test_request_output_has_vllms_fields_in_order(llm):
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert names == ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
                     "metrics", "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens"]
    before = time.time()
    out = llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0]
    m = out.metrics  # vLLM V0's RequestMetrics: wall-clock times in order
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
        <= m.finished_time <= time.time()
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids) == (None,) * 3
    assert out.outputs[0].lora_request is None and isinstance(out.outputs[0], CompletionOutput)


# 6. LMDeploy engine configs: tuning-only fields accepted with a warning, the rest refused

@pytest.mark.parametrize("cfg, name", [
    (TurbomindEngineConfig(cache_chunk_size=4), "cache_chunk_size"),
    (TurbomindEngineConfig(num_tokens_per_iter=256), "num_tokens_per_iter"),
    (TurbomindEngineConfig(max_prefill_iters=3), "max_prefill_iters"),
    (TurbomindEngineConfig(use_context_fmha=0), "use_context_fmha"),
    (PytorchEngineConfig(eviction_type="copy"), "eviction_type"),
    (PytorchEngineConfig(num_cpu_blocks=4), "num_cpu_blocks"),
    (PytorchEngineConfig(prefill_interval=4), "prefill_interval"),
])
def test_lmdeploy_tuning_fields_are_accepted_with_a_warning(cfg, name, caplog):
    with caplog.at_level(logging.WARNING, logger="lmjax"):
        lowered = cfg.to_engine_config()
    assert lowered == type(cfg)().to_engine_config()
    assert f"{type(cfg).__name__}({name}=" in caplog.text and "has no effect" in caplog.text


@pytest.mark.parametrize("make, match", [
    (lambda: PytorchEngineConfig(adapters={"a": "/p"}).to_engine_config(), "adapters"),
    (lambda: TurbomindEngineConfig(model_format="llama").to_engine_config(), "model_format"),
    (lambda: TurbomindEngineConfig(kv_bits=4).to_engine_config(), "kv_bits"),
    (lambda: TurbomindEngineConfig(num_tokens_per_iter=-1), "num_tokens_per_iter"),
    (lambda: PytorchEngineConfig(num_cpu_blocks=-1), "num_cpu_blocks"),
])
def test_lmdeploy_fields_that_change_results_still_raise(make, match):
    with pytest.raises((NotImplementedError, ValueError), match=match):
        make()


def test_detokenize_false_gives_ids_only(llm):
    """vLLM's detokenize=False: the same tokens, no text, no decoded tokens in the logprobs."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1)
    text, ids = (llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]
                 for p in (params, dataclasses.replace(params, detokenize=False)))
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids.outputs[0].text == ""
    assert all(lp.decoded_token is None for step in ids.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in ids.prompt_logprobs[1:] for lp in step.values())
    assert all(lp.decoded_token for step in text.outputs[0].logprobs for lp in step.values())


def test_vllm_arguments_at_their_defaults_are_accepted(tmp_path):
    """vLLM code passes these at vLLM's defaults (they were a TypeError); the ones that would change the model
    are NotImplementedError off their default, the tuning-only ones take any value."""
    from conftest import write_tiny_llama

    path = write_tiny_llama(tmp_path)
    llm = LLM(path, max_model_len=32, task="auto", download_dir=None, pipeline_parallel_size=1, load_format="auto",
              distributed_executor_backend=None, hf_overrides=None)
    assert llm.generate("t5", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        LLM(path, pipeline_parallel_size=2)
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(path, no_such_argument=1)


@pytest.mark.parametrize("task", ["classify", "score", "reward", "transcription", "generat"])
def test_a_task_lmjax_does_not_serve_is_refused_before_loading(task):
    """vLLM's tasks that need a head lmjax has not (and typos) were accepted with a log line."""
    with pytest.raises(NotImplementedError, match=f"task={task!r}"):
        LLM("/no/such/model", task=task)
