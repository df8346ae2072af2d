"""Logits processors (vLLM's SamplingParams, LMDeploy's GenerationConfig) and LMDeploy's output_logits /
output_last_hidden_state, on one tiny random float32 Llama (word-level vocabulary t0..t255, t3 ends a
sequence): processors steer their own rows only, see the right ids, run before logit_bias, keep raw
logprobs, and a failing one ends only its own request; the rows handed back equal transformers' logits
and final hidden states at the same positions."""
import numpy as np
import pytest
import torch

from conftest import write_tiny_llama
from lmjax import GenerationConfig, LLM, SamplingParams, pipeline
from lmjax.engine.host_outputs import call_processors


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=128, enable_prefix_caching=True, block_size=16)


@pytest.fixture(scope="module")
def hf(path):
    import transformers
    return transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def _greedy(max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _only(token: int):
    def processor(output_ids, logits):
        logits[:] = -np.inf
        logits[token] = 0.0
        return logits
    return processor


def test_processors_steer_their_rows_and_see_the_ids(llm):
    alone = llm.generate(["t5 t9 t12"], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    seen = []

    def record(prompt_ids, output_ids, logits):  # vLLM's three-argument form
        seen.append((list(prompt_ids), list(output_ids)))
        return logits

    outs = llm.generate(["t5 t9 t12", "t7 t8", "t7 t8"],
                        [_greedy(), _greedy(logits_processors=[_only(42)]), _greedy(logits_processors=[record])],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # the batch's unprocessed row: what it gets alone
    assert outs[1].outputs[0].token_ids == [42] * 6
    recorded = outs[2].outputs[0].token_ids
    assert [s[0] for s in seen] == [outs[2].prompt_token_ids] * 6
    assert [s[1] for s in seen] == [recorded[:i] for i in range(6)]


def test_processors_run_before_logit_bias_and_logprobs_stay_raw(llm):
    seen = []

    def ban(output_ids, logits):
        seen.append(float(logits[42]))
        logits[42] = -np.inf
        return logits

    out = llm.generate(["t7 t8"], _greedy(logits_processors=[ban], logit_bias={42: 100.0}), use_tqdm=False)
    assert 42 not in out[0].outputs[0].token_ids
    assert len(seen) == 6 and max(seen) < 20  # the raw logit, not the biased one: the processor comes first
    forced = llm.generate(["t7 t8"], _greedy(max_tokens=3, logits_processors=[_only(42)], logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    raw = llm.generate(["t7 t8"], _greedy(max_tokens=1, logprobs=1), use_tqdm=False)[0].outputs[0]
    chosen = forced.logprobs[0][42].logprob
    assert chosen < 0 and raw.logprobs[0][raw.token_ids[0]].logprob > chosen  # 42 was not the model's pick


def test_a_failing_processor_ends_only_its_request(llm):
    def boom(output_ids, logits):
        raise RuntimeError("processor bug")

    def wrong_shape(output_ids, logits):
        return logits[:5]

    outs = llm.generate(["t5 t9 t12", "t7 t8", "t7 t8"],
                        [_greedy(), _greedy(logits_processors=[boom]), _greedy(logits_processors=[wrong_shape])],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 6 and outs[0].outputs[0].finish_reason == "length"
    assert [o.outputs[0].finish_reason for o in outs[1:]] == ["error", "error"]
    errors = [llm.llm_engine.requests.get(o.request_id) for o in outs[1:]]
    assert all(e is None for e in errors)  # finished and forgotten; the engine goes on
    assert llm.generate(["t7 t8"], _greedy(), use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"returned shape \(5,\), expected \(256,\)"):
        call_processors([wrong_shape], [1], [], np.zeros(256, np.float32))


def test_lmdeploy_processors_get_prompt_and_output_ids(path):
    seen = []

    def record(input_ids, logits):
        seen.append(input_ids)
        return logits

    pipe = pipeline(path)
    r = pipe(["t5 t9"], gen_config=GenerationConfig(max_new_tokens=3, ignore_eos=True, logits_processors=[record]),
             do_preprocess=False)[0]
    prompt = pipe.engine.tokenizer.encode("t5 t9")
    assert all(ids.dtype == np.int64 for ids in seen)
    assert [ids.tolist() for ids in seen] == [prompt + r.token_ids[:i] for i in range(3)]


def test_output_logits_and_hidden_states_match_transformers(llm, hf):
    params = _greedy(max_tokens=5, output_logits="all", output_last_hidden_state="generation")
    prompt = " ".join(f"t{i}" for i in range(10, 50))  # 40 tokens: two full blocks of 16
    llm.generate([prompt], _greedy(), use_tqdm=False)  # blocks a prefix-cache hit would reuse
    req = _finished_request(llm, prompt, params)
    out = req.completions[0]
    prompt, gen = req.prompt_token_ids, out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + gen[:-1]]), output_hidden_states=True)
    ref_logits = ref.logits[0].numpy()
    ref_hidden = ref.hidden_states[-1][0].numpy()  # after the final norm, as lmjax's and LMDeploy's
    logits, hidden = out.host_rows.stacked("logits"), out.host_rows.stacked("hidden")
    assert logits.shape == (len(prompt) + len(gen) - 1, 256)  # every position, the cached prefix included
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=1e-4)
    assert hidden.shape == (len(gen), 64)
    np.testing.assert_allclose(hidden, ref_hidden[len(prompt) - 1:], atol=2e-4, rtol=1e-4)
    assert gen == ref_logits[len(prompt) - 1:].argmax(-1).tolist()


def test_pipeline_responses_carry_the_rows(path, hf):
    pipe = pipeline(path)
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True, output_logits="generation")
    r = pipe(["t5 t9"], gen_config=gen, do_preprocess=False)[0]
    streamed = [x for x in pipe.stream_infer(["t5 t9"], gen_config=gen, do_preprocess=False)]
    prompt = pipe.engine.tokenizer.encode("t5 t9")
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + r.token_ids[:-1]])).logits[0, len(prompt) - 1:].numpy()
    np.testing.assert_allclose(r.logits, ref, atol=2e-4, rtol=1e-4)
    assert r.last_hidden_state is None
    assert streamed[-1].logits.shape == (4, 256) and all(x.logits is None for x in streamed[:-1])
    from lmjax import AsyncEngine
    with AsyncEngine(path) as engine:  # its engine thread's outputs (GenOut) carry them too
        a = engine.batch_infer(["t5 t9"], gen_config=gen, do_preprocess=False)[0]
    np.testing.assert_allclose(a.logits, ref, atol=2e-4, rtol=1e-4)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="output_logits must be None, 'generation' or 'all', got 'last'"):
        SamplingParams(output_logits="last")
    with pytest.raises(ValueError, match="logits_processors must be callables, got 3"):
        GenerationConfig(logits_processors=[3])
    p = SamplingParams(logits_processors=[_only(1)])
    assert p.clone().logits_processors[0] is p.logits_processors[0]  # shared, as vLLM's clone does


def _finished_request(llm, prompt: str, params: SamplingParams):
    engine = llm.llm_engine
    req = engine.add_request(engine.tokenizer.encode(prompt), params)
    while not req.finished:
        engine.step()
    return req


def test_embed_is_the_normalized_last_hidden_state(llm, hf):
    from lmjax import PoolingParams

    prompts = ["t5 t9 t12 t30", "t7 t8"]
    outs = llm.embed(prompts, use_tqdm=False)
    raw = llm.embed([{"prompt_token_ids": outs[1].prompt_token_ids}], use_tqdm=False,
                    pooling_params=PoolingParams(normalize=False))[0]
    for out in outs:
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        np.testing.assert_allclose(out.outputs.embedding, ref / np.linalg.norm(ref), atol=1e-5)
        assert out.outputs.hidden_size == 64
    np.testing.assert_allclose(np.linalg.norm(raw.outputs.embedding) * np.asarray(outs[1].outputs.embedding),
                               raw.outputs.embedding, atol=1e-5)
    assert llm.embed("t7 t8", truncate_prompt_tokens=2, use_tqdm=False)[0].prompt_token_ids == \
        outs[1].prompt_token_ids[-2:]
    with pytest.raises(NotImplementedError, match="dimensions=32"):
        PoolingParams(dimensions=32)
