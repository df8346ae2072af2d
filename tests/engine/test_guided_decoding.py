"""Structured outputs on SmolLM2's weights and tokenizer (its pruned copy, conftest.write_smollm2_pruned: a
fifth of the compile time; the guide, not the model, makes the output valid): greedy decoding with a JSON
schema gives JSON that validates against it, a regex a full match, a choice one of the choices, through
vLLM's SamplingParams(guided_decoding=...) and LMDeploy's GenerationConfig(response_format=...) alike, all in
one batch (each row its own guide and mask). The schemas bound every field, so even a weak model ends
within max_tokens. Also: the real tokenizer's vocabulary as outlines sees it (the bytes of each token id)."""
import json
import re

import jsonschema
import pytest

import lmjax
from lmjax import GenerationConfig, GuidedDecodingParams, SamplingParams, TurbomindEngineConfig
from lmjax.engine.guided import _sentencepiece_bytes, vocabulary_map
from lmjax.engine.guided_regex import ascii_digits

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "maxDigits": 3}}, "required": ["name", "age"]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "capital": {"type": "boolean"}},
        "required": ["city", "capital"]}
CHOICES = ["Paris", "London", "Berlin"]


@pytest.fixture(scope="module")
def pipe(smollm2_pruned):
    return lmjax.pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256, max_batch_size=4,
                                                                             dtype="float32"), log_level="ERROR")


@pytest.fixture(scope="module")
def outputs(pipe):
    def greedy(**guide):
        return SamplingParams(temperature=0, max_tokens=120, **guide)
    prompts = ["Describe a person named Alice who is 30 years old as JSON.", "Give me a phone number.",
               "What is the capital of France?", "Name a big city in Japan, as JSON."]
    configs = [greedy(guided_decoding=GuidedDecodingParams(json=PERSON)),
               greedy(guided_decoding=GuidedDecodingParams(regex=r"\d{3}-\d{4}")),
               greedy(structured_outputs=GuidedDecodingParams(choice=CHOICES)),
               GenerationConfig(max_new_tokens=120, response_format=dict(type="json_schema", json_schema=dict(
                   name="city", schema=CITY)))]
    return pipe([[{"role": "user", "content": p}] for p in prompts], gen_config=configs)


def test_json_schema_output_validates(outputs):
    jsonschema.validate(json.loads(outputs[0].text), PERSON)
    assert outputs[0].finish_reason == "stop"


def test_regex_output_matches_with_ascii_digits(outputs):
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[1].text) and outputs[1].finish_reason == "stop"


def test_choice_output_is_one_of_them(outputs):
    assert outputs[2].text in CHOICES and outputs[2].finish_reason == "stop"


SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""  # vLLM's EBNF example (its docs' guided_grammar)
ANSWER = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/'  # Lark


def test_grammar_outputs_follow_their_grammar_in_one_batch_with_other_guides(pipe):
    greedy = SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(grammar=SQL))
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                             guided_decoding=GuidedDecodingParams(grammar=ANSWER))
    regex = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(regex=r"\d{3}-\d{4}"))
    prompts = ["Write an SQL query.", "What is 6 times 7?", "Give me a phone number."]
    sql, answer, phone = pipe([[{"role": "user", "content": p}] for p in prompts], gen_config=[greedy, sampled, regex])
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", sql.text), sql.text
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", answer.text), answer.text
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text)
    assert sql.finish_reason == answer.finish_reason == phone.finish_reason == "stop"


def test_lmdeploy_response_format(outputs):
    jsonschema.validate(json.loads(outputs[3].text), CITY)


def test_vocabulary_bytes_spell_each_token(pipe):
    """Byte-level BPE: each token's bytes decode to the tokenizer's own text for it (where that text is whole
    characters); special tokens and EOS are left out of the guided vocabulary."""
    tokenizer = pipe.engine.tokenizer
    by_id = {i: data for data, ids in vocabulary_map(tokenizer, {2}).items() for i in ids}
    assert 2 not in by_id and 0 not in by_id and len(by_id) > 49000
    for i in range(0, 49152, 97):
        if i in by_id:
            text = tokenizer.decode([i], clean_up_tokenization_spaces=False)
            assert by_id[i].decode(errors="replace") == text or "\ufffd" in text, i
    assert by_id[tokenizer.convert_tokens_to_ids("Ġ{")] == b" {"


def test_regex_helpers():
    assert _sentencepiece_bytes("\u2581Hello") == b" Hello" and _sentencepiece_bytes("<0x0A>") == b"\n"
    assert ascii_digits(r"\d{3}[\d-]\\d\.") == r"[0-9]{3}[0-9-]\\d\."
