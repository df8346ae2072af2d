"""LMDeploy's first turn through role markers, its "base" template (no chat template) or capability="completion"
starts with the tokenizer's BOS, as LMDeploy's encode(prompt, add_bos=True) gives it (probe 24): lmjax
tokenized every rendered chat without special tokens, which is right only for a Jinja template (its text holds
the BOS it wants), so pipeline(llama2_like)("Hello world") ran without <s>. Tiny Llama with the SentencePiece
test tokenizer (it adds <s>), no chat template."""
import pytest

from conftest import write_tiny_llama
from lmjax import ChatTemplateConfig, GenerationConfig, TurbomindEngineConfig, pipeline
from sentencepiece_tokenizer import write_sentencepiece_tokenizer

MARKERS = dict(system="<|im_start|>system\n", meta_instruction="You are an AI assistant.", eosys="<|im_end|>\n",
               user="<|im_start|>user\n", eoh="<|im_end|>\n", assistant="<|im_start|>assistant\n", eoa="<|im_end|>",
               separator="\n")
CONFIG = dict(session_len=512, dtype="float32", cache_max_entry_count=16)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("bos"), write_sentencepiece_tokenizer, vocab_size=400)
    with pipeline(path, backend_config=TurbomindEngineConfig(**CONFIG)) as pipe:
        yield pipe


@pytest.mark.parametrize("config", [None, MARKERS, {"capability": "completion"}], ids=["base", "markers", "completion"])
def test_a_first_turn_without_a_jinja_template_starts_with_bos(pipe, config):
    template = ChatTemplateConfig(**config) if config else None
    resp = pipe("Hello world", gen_config=GenerationConfig(max_new_tokens=1), chat_template_config=template)
    text = (template or ChatTemplateConfig()).messages2prompt("Hello world", pipe.tokenizer)
    want = pipe.tokenizer(text)["input_ids"]
    assert want[0] == pipe.tokenizer.bos_token_id and resp.input_token_len == len(want), text
