"""vLLM parity findings of probe 24 (tiny random Llama, word-level vocabulary t0..t255):
- logprobs / prompt_logprobs -1 mean the whole vocabulary (were refused), within max_logprobs;
- seed -1 means no seed, as vLLM (every seed=-1 request sampled the same tokens);
- a prompt dict's multi_modal_data (or any field but prompt / prompt_token_ids) is refused, not dropped;
- vLLM arguments at their defaults run: SamplingParams(extra_args=...), SamplingParams.from_optional,
  generate(priority=None), chat(chat_template_content_format="auto", mm_processor_kwargs=None);
- LLM.set_tokenizer; embed with a list of PoolingParams, one per prompt;
- llm.llm_engine answers vLLM's get_tokenizer / has_unfinished_requests / get_num_unfinished_requests /
  abort_request."""
import math

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, PoolingParams, SamplingParams

PROMPT = "t1 t5 t6"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny")), max_model_len=128, num_gpu_blocks_override=64,
               block_size=16, max_num_seqs=8, max_logprobs=-1)


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert [len(d) for d in out.outputs[0].logprobs] == [vocab, vocab]
    assert out.prompt_logprobs[0] is None and all(len(d) == vocab for d in out.prompt_logprobs[1:])


def test_logprobs_minus_one_is_held_to_max_logprobs(tmp_path):
    capped = LLM(write_tiny_llama(tmp_path), max_model_len=64, max_logprobs=20)
    with pytest.raises(ValueError, match="logprobs=256 is more than max_logprobs=20"):
        capped.generate(PROMPT, SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)


def test_seed_minus_one_is_no_seed(llm):
    assert SamplingParams(seed=-1).seed is None
    outs = llm.generate([PROMPT, PROMPT], SamplingParams(seed=-1, temperature=1.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # 256**-8 to tie by chance


@pytest.mark.parametrize("prompt", [{"prompt": PROMPT, "multi_modal_data": {"image": b"x"}},
                                    {"prompt_token_ids": [1, 5, 6], "mm_processor_kwargs": {}}])
def test_a_prompt_field_lmjax_does_not_read_is_refused(llm, prompt):
    with pytest.raises(NotImplementedError, match=sorted(set(prompt) - {"prompt", "prompt_token_ids"})[0]):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(NotImplementedError):
        llm.embed(prompt, use_tqdm=False)


def test_vllm_arguments_at_their_defaults_run(llm):
    assert SamplingParams(extra_args={"x": 1}).extra_args == {"x": 1}
    sp = SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=5)
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (1.0, 1.0, 5)
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False, priority=None)) == 1
    with pytest.raises(NotImplementedError, match="priority"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}t9"
    out = llm.chat([{"role": "user", "content": "t5"}], SamplingParams(max_tokens=2), use_tqdm=False,
                   chat_template=template, chat_template_content_format="auto", mm_processor_kwargs=None)
    assert out[0].prompt_token_ids == [5, 9]
    with pytest.raises(NotImplementedError, match="chat_template_content_format"):
        llm.chat([{"role": "user", "content": "t5"}], chat_template=template, chat_template_content_format="openai")


def test_set_tokenizer_and_vllm_engine_names(llm):
    tok = llm.get_tokenizer()
    llm.set_tokenizer(tok)
    assert llm.get_tokenizer() is tok and llm.llm_engine.get_tokenizer() is tok
    engine = llm.llm_engine
    assert engine.has_unfinished_requests() is False and engine.get_num_unfinished_requests() == 0
    req = engine.add_request([1, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 1
    engine.abort_request([req.request_id, "no-such-request"])  # unknown ids are ignored, as vLLM
    assert not engine.has_unfinished_requests() and req.completions[0].finish_reason == "abort"


def test_embed_takes_one_pooling_params_per_prompt(llm):
    outs = llm.embed([PROMPT, "t1 t4"], pooling_params=[PoolingParams(normalize=False), PoolingParams()],
                     use_tqdm=False)
    norms = [math.sqrt(sum(x * x for x in o.outputs.embedding)) for o in outs]
    assert abs(norms[1] - 1.0) < 1e-4 and abs(norms[0] - 1.0) > 1e-3
