"""LMDeploy pipeline behaviours a read-only probe found missing (each test failed before): a message list that
ends with the assistant's message continues that reply (LMDeploy's response prefix, both with role markers and
with the tokenizer's template); pipe.chat records a turn in the session only once it completes (an abandoned
stream or a failed call leaves the history as it was); get_ppl scores a sequence of session_len tokens, as
get_logits takes it."""
import numpy as np
import pytest
import torch
import transformers

from conftest import write_tiny_llama
from lmjax import ChatTemplateConfig, GenerationConfig, TurbomindEngineConfig, pipeline
from lmjax.api.batch import encode_chat

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]


def test_markers_last_assistant_message_is_response_prefix(smollm2_tokenizer):
    cfg = ChatTemplateConfig(user="U:", eoh="\n", assistant="A:", eoa="</s>", separator="\n")
    text, _ = encode_chat(smollm2_tokenizer, MSGS, cfg)  # what pipe(MSGS) feeds the engine
    assert text == "U:hi\nA:The answer is"


def test_hf_template_last_assistant_message_is_response_prefix(smollm2_tokenizer):
    text, _ = encode_chat(smollm2_tokenizer, MSGS, ChatTemplateConfig())
    assert text.endswith("<|im_start|>assistant\nThe answer is"), text


@pytest.fixture(scope="module")
def pipe(smollm2_pruned):
    return pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256, cache_max_entry_count=64))


def test_abandoned_stream_turn_not_in_history(pipe):
    g = GenerationConfig(max_new_tokens=6)
    session = pipe.session()
    stream = pipe.chat("Hi", session=session, gen_config=g, stream_response=True)
    next(stream)
    stream.close()  # the user gave up on this turn
    pipe.chat("Tell me more", session=session, gen_config=g)
    assert [m["role"] for m in session.messages] == ["user", "assistant"], session.messages
    assert session.history == [("Tell me more", session.response.text)]


def test_failed_turn_not_in_history(pipe):
    session = pipe.session()
    with pytest.raises(TypeError):
        pipe.chat("Hi", session=session, gen_config={"max_new_tokens": 4})  # not a GenerationConfig
    pipe.chat("Hello", session=session, gen_config=GenerationConfig(max_new_tokens=4))
    assert [m["role"] for m in session.messages] == ["user", "assistant"], session.messages


def test_get_ppl_at_session_len(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny")
    pipe = pipeline(path, backend_config=TurbomindEngineConfig(session_len=32, cache_max_entry_count=16))
    ids = np.random.default_rng(0).integers(3, 256, 32).tolist()
    logits = pipe.get_logits(ids)[0]  # accepted: [32, vocab]
    assert logits.shape == (32, 256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf(torch.tensor([ids])).logits[0, :-1], torch.tensor(ids[1:])).item()
    assert abs(pipe.get_ppl(ids)[0] - ref) < 1e-4  # was a ContextOverflowError
