"""Grammar-guide fixes found by probe and review 28: a grammar or structural tag may name a special token (`<|im_end|>`,
a `<|im_start|>` trigger) as vLLM's guidance backend lets it; a model without any EOS id runs grammars; GBNF's
\\uXXXX / \\UXXXXXXXX escapes mean their characters (llguidance's converter dropped the leading zeros); vLLM's
guided_options_request carries structural_tag."""
import json
from dataclasses import dataclass

import numpy as np
import pytest

from lmjax import GuidedDecodingParams, SamplingParams
from lmjax.api.llm import _guide_from_options
from lmjax.engine.guided import GuidedDecoding
from sentencepiece_tokenizer import pieces, sentencepiece_tokenizer


def _ids(state) -> list[int]:
    return np.nonzero(np.unpackbits(state.mask_W().view(np.uint8), bitorder="little"))[0].tolist()


def _params(**guide) -> SamplingParams:
    return SamplingParams(guided_decoding=GuidedDecodingParams(**guide))


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    return tok, GuidedDecoding(tok, len(tok), [tok.eos_token_id])


def test_a_grammar_may_name_a_special_token(smollm2):
    tok, guided = smollm2
    endoftext, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end == tok.eos_token_id != endoftext
    for grammar, named in (('start: "yes" <|endoftext|>', endoftext), ('start: "yes" <|im_end|>', im_end)):
        state = guided.new_state(_params(grammar=grammar), None)  # was: "unknown special token"
        for token in tok.encode("yes", add_special_tokens=False):
            assert state.advance(token) is None
        assert _ids(state) == [named], grammar
    state = guided.new_state(_params(grammar='start: "yes" <|endoftext|>'), None)
    for token in [*tok.encode("yes", add_special_tokens=False), endoftext]:
        result = state.advance(token)
    assert result == "stop" and state.complete


def test_a_structural_tag_may_trigger_on_a_special_token(smollm2):
    tok, guided = smollm2
    tag = {"type": "structural_tag", "triggers": ["<|im_start|>"],
           "structures": [{"begin": "<|im_start|>", "schema": {"type": "object"}, "end": "x"}]}
    state = guided.new_state(_params(structural_tag=tag), None)
    assert state.advance(tok.convert_tokens_to_ids("<|im_start|>")) is None
    assert {tok.decode([i]).lstrip()[:1] for i in _ids(state)} == {"{"}


def test_a_model_without_an_eos_id_runs_grammars():
    tok = sentencepiece_tokenizer()
    tok.eos_token = None
    guided = GuidedDecoding(tok, len(pieces()), [])  # what the engine builds when eos_token_ids == []
    tag = {"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}
    for guide in (dict(grammar='root ::= "ab" [0-9]'), dict(structural_tag=tag)):
        params = _params(**guide)
        guided.check(params)  # was: "EOS token ID 327 is out of range (vocab_size=327)"
        assert _ids(guided.new_state(params, None)) and max(_ids(guided.new_state(params, None))) < len(pieces())


@pytest.mark.parametrize("literal, escaped", [
    ('root ::= "café"', r'root ::= "caf\u00e9"'), ('root ::= [à-ÿ]', r'root ::= [\u00e0-\u00ff]'),
    ('root ::= "Ж"', r'root ::= "\u0416"'), ('root ::= "😀"', r'root ::= "\U0001F600"'),
    ('root ::= [😀-🙏]', r'root ::= [\U0001F600-\U0001F64F]'), ('root ::= "\\"a"', r'root ::= "\u0022a"'),
])
def test_gbnf_unicode_escapes_mean_their_characters(smollm2, literal, escaped):
    tok, guided = smollm2
    first = [_ids(guided.new_state(_params(grammar=g), None)) for g in (escaped, literal)]
    assert first[0] == first[1] and first[0]


@dataclass
class GuidedDecodingRequest:  # vLLM's guided_options_request object (its guided_fields.py), the fields used here
    guided_json: object = None
    guided_grammar: str | None = None
    structural_tag: str | None = None


def test_guided_options_request_carries_structural_tag():
    tag = json.dumps({"type": "structural_tag", "triggers": ["<f="],
                      "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]})
    for options in ({"structural_tag": tag}, GuidedDecodingRequest(structural_tag=tag)):
        assert _guide_from_options(options).structural_tag == tag  # was: TypeError / dropped


def test_a_structural_tag_trigger_written_like_a_tag_is_text_where_no_special_token_has_its_name(smollm2):
    # review 28: llguidance read every "<...>" trigger as a special token ("unknown special token: <tool_call>")
    tok, guided = smollm2
    tag = {"type": "structural_tag", "triggers": ["<tool_call>"],
           "structures": [{"begin": "<tool_call>", "schema": {"type": "object"}, "end": "</tool_call>"}]}
    state = guided.new_state(_params(structural_tag=tag), None)
    for token in tok.encode("Sure. <tool_call>", add_special_tokens=False):
        assert state.advance(token) is None
    assert not state.complete and {tok.decode([i]).lstrip()[:1] for i in _ids(state)} == {"{"}
    for token in tok.encode('{"a": 1}</tool_call> Done.', add_special_tokens=False):
        assert state.advance(token) is None
    assert state.complete


def test_an_all_of_schema_keeps_each_branch_open_to_the_others_properties():
    # review 28: additionalProperties false on each allOf branch made {"a": .., "b": ..} unsatisfiable
    from char_tokenizer import CharTokenizer

    chars = list('0123456789{}":,ab')
    guided = GuidedDecoding(CharTokenizer(chars), len(chars) + 1, [0])
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    state = guided.new_state(_params(json=schema, disable_any_whitespace=True), None)
    for c in '{"a":1,"b":2}':
        assert state.advance(chars.index(c) + 1) in (None, "stop"), c
    assert state.complete


@pytest.mark.parametrize("schema", [{"type": 5, "minimum": 1}, {"type": ["number", {"x": 1}], "maximum": 3}])
def test_a_malformed_type_beside_a_bound_is_a_value_error_naming_it(smollm2, schema):
    with pytest.raises(ValueError, match=r'"type" must be a string or a list of strings, got'):
        smollm2[1].check(_params(json=schema))


class PanicException(BaseException):
    """pyo3's exception for a Rust panic (llguidance's): a BaseException, which `except Exception` misses."""


class _PanickingMatcher:
    def __init__(self, where):
        self.where = where

    def deep_copy(self):
        return self

    def unsafe_compute_mask_ptr(self, address, size):
        if self.where == "mask":
            raise PanicException("range start index out of range")

    def compute_ff_bytes(self):
        return b""

    def is_accepting(self):
        return False

    def is_stopped(self):
        return False

    def consume_token(self, token):
        raise PanicException("index out of bounds")

    def get_error(self):
        return ""


@pytest.mark.parametrize("where", ["mask", "advance"])
def test_a_panic_inside_llguidance_ends_only_its_completion(smollm2, where):
    from lmjax.engine.guided_grammar import GrammarState

    state = GrammarState(smollm2[1], _PanickingMatcher(where), None, False)
    assert not state.mask_W().any() if where == "mask" else state.mask_W() is not None
    assert state.advance(5) == "error" and "failed inside llguidance" in state.error


def test_a_lark_grammar_may_start_with_an_inlined_rule(smollm2):
    """Review 35: vLLM's SQL example (`?start:` and `?rule:` inline their rules in Lark) was sent to the GBNF
    converter ("Expected name at line 1"); it is Lark: no `::=`."""
    tok, guided = smollm2
    sql = "\n".join(['?start: select_statement', '?select_statement: "SELECT " column_list " FROM " table_name',
                     '?column_list: column_name ("," column_name)*', '?table_name: identifier',
                     '?column_name: identifier', '?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/'])
    state = guided.new_state(_params(grammar=sql), None)
    for token in tok.encode("SELECT a,b FROM t", add_special_tokens=False):
        assert token in _ids(state), tok.decode([token])
        state.advance(token)
    assert tok.eos_token_id in _ids(state)
    guided.check(_params(grammar='root ::= "yes" | "no"'))  # GBNF still converted


def test_a_json_whitespace_pattern_allows_json_whitespace_only(smollm2):
    """Review 35: with whitespace_pattern r"\\s*" llguidance's Unicode \\s let U+3000, U+0085, \\x0b into a JSON
    output that finished "stop" and json.loads refused; `\\s` now means JSON's space, tab, LF and CR, and a pattern
    that matches anything else is refused by name."""
    tok, guided = smollm2
    state = guided.new_state(_params(json_object=True, whitespace_pattern=r"\s*"), None)
    state.advance(tok.convert_tokens_to_ids("{"))
    allowed = set(_ids(state))
    assert tok.convert_tokens_to_ids("ã") not in allowed  # the first byte of U+3000 (e3 80 80)
    assert {tok.convert_tokens_to_ids(t) for t in ("Ċ", "Ġ", '"', "}")} <= allowed  # "\n", " ", '"', "}"
    with pytest.raises(ValueError, match=r"whitespace_pattern '\[a-z\]\*' matches 'a'"):
        guided.check(_params(json_object=True, whitespace_pattern="[a-z]*"))
