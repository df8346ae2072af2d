"""Generation semantics where lmjax now does what vLLM does (a read-only probe found each; every test failed
before its fix): the first listed of two stop strings that complete on the same token wins; a bad word given
with a leading space bans its bare form too; stop_reason is None only for the tokenizer's EOS (another EOS id
of the checkpoint's, a stop id to vLLM, gives its id, and so does a stop_token_ids id); a completion's text is
the same read once at the end (generate) or streamed (a broken UTF-8 byte run keeps its good characters)."""
import numpy as np
import pytest

import lmjax
from conftest import write_tiny_llama
from lmjax import SamplingParams
from sentencepiece_tokenizer import write_sentencepiece_tokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return lmjax.LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny")), max_model_len=64)


def _one(llm, prompt="t1 t2 t3", **kw):
    return llm.generate([prompt], SamplingParams(**{"temperature": 0, **kw}), use_tqdm=False)[0].outputs[0]


def test_first_listed_stop_string_wins(llm):
    t39 = llm.get_tokenizer().convert_tokens_to_ids("t39")
    assert _one(llm, max_tokens=1, logit_bias={t39: 100.0}).text == " t39"
    out = _one(llm, max_tokens=4, logit_bias={t39: 100.0}, stop=["39", "t3"])  # both end with that token
    assert (out.stop_reason, out.text) == ("39", " t")
    out = _one(llm, max_tokens=4, logit_bias={t39: 100.0}, stop=["t3", "39"])
    assert (out.stop_reason, out.text) == ("t3", " ")


def test_stop_reason_of_eos_ids(llm):
    assert llm.get_tokenizer().eos_token_id == 0 and 2 in llm.llm_engine.eos_token_ids  # 2: the config's EOS
    other = _one(llm, max_tokens=4, logit_bias={2: 50.0})
    assert (other.token_ids, other.finish_reason, other.stop_reason) == ([2], "stop", 2)
    eos = _one(llm, max_tokens=4, logit_bias={0: 50.0}, stop_token_ids=[0])  # vLLM checks the EOS first
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([0], "stop", None)
    listed = _one(llm, max_tokens=4, logit_bias={7: 50.0}, stop_token_ids=[7])
    assert (listed.token_ids, listed.stop_reason) == ([7], 7)


def test_bad_word_with_a_leading_space_bans_its_bare_form(smollm2_pruned):
    llm = lmjax.LLM(smollm2_pruned, max_model_len=64)
    paris = llm.get_tokenizer().encode("Paris", add_special_tokens=False)
    assert len(paris) == 1
    free = _one(llm, "The capital of France is", max_tokens=1, logit_bias={paris[0]: 100.0})
    assert free.token_ids == paris
    out = _one(llm, "The capital of France is", max_tokens=1, logit_bias={paris[0]: 100.0}, bad_words=[" Paris"])
    assert out.token_ids != paris


FORCED = [5 + 0x2F, 5 + 0x80, 5 + 0x80]  # byte-fallback pieces <0x2F> "/", then two stray bytes <0x80>


def _force(output_ids, logits):
    out = np.full_like(logits, -np.inf)
    out[FORCED[len(output_ids)]] = 0.0
    return out


def test_generate_text_equals_streamed_text_on_a_broken_byte_run(tmp_path):
    path = write_tiny_llama(tmp_path, tokenizer=write_sentencepiece_tokenizer, vocab_size=384)
    llm = lmjax.LLM(path, max_model_len=64)
    kw = dict(max_tokens=len(FORCED), temperature=0, logits_processors=[_force])
    done = llm.generate(["Hello world"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    assert done.token_ids == FORCED
    engine = lmjax.LLMEngine(llm)
    engine.add_request("s", "Hello world", SamplingParams(output_kind=lmjax.RequestOutputKind.DELTA, **kw))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text
    assert streamed.startswith("/") and done.text == streamed


def test_truncate_prompt_tokens_keeps_the_prompt_and_takes_minus_one(llm):
    """vLLM: RequestOutput.prompt stays the text given (was None after a cut); -1 cuts to the model's limit
    (here max_model_len - 1 = 63 tokens, the longest prompt that leaves room for one)."""
    prompt = " ".join(f"t{i}" for i in range(5, 105))
    full = llm.get_tokenizer()(prompt)["input_ids"]
    assert len(full) >= 100
    for k, kept in ((3, 3), (-1, 63)):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=k),
                           use_tqdm=False)[0]
        assert out.prompt == prompt and out.prompt_token_ids == full[-kept:]
