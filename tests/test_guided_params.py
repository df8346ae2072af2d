"""Structured-output parameters as vLLM and LMDeploy users write them: vLLM's GuidedDecodingParams (and its
newer name StructuredOutputsParams) in SamplingParams, LMDeploy's response_format in GenerationConfig; bad
ones are errors naming the value, on creation."""
import json

import pytest

import lmjax
from lmjax import GenerationConfig, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from lmjax.guided_params import from_response_format

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_vllm_guided_decoding_and_its_alias():
    p = SamplingParams(guided_decoding=GuidedDecodingParams(json=SCHEMA))
    assert p.guided_decoding.kind == "json" and '"required": ["name"]' in p.guided_decoding.spec
    alias = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\d+"))
    assert alias.guided_decoding.regex == r"\d+" and alias.structured_outputs is None
    assert SamplingParams(guided_decoding={"choice": ["a", "b"]}).guided_decoding.choice == ["a", "b"]
    # a JSON string and a dict are the same schema (one compiled guide)
    assert GuidedDecodingParams(json='{"type": "integer"}').spec == GuidedDecodingParams(json={"type": "integer"}).spec
    assert GuidedDecodingParams(json_object=True, disable_any_whitespace=True).whitespace == ""
    assert GuidedDecodingParams.from_optional() is None
    assert "GuidedDecodingParams" in dir(lmjax) and "StructuredOutputsParams" in lmjax.__all__


def test_allowed_token_ids_is_implemented():
    assert SamplingParams(allowed_token_ids=[3, 4]).allowed_token_ids == [3, 4]
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids must hold int"):
        SamplingParams(allowed_token_ids=["a"])


@pytest.mark.parametrize("make, message", [
    (lambda: GuidedDecodingParams(), "exactly one of"),
    (lambda: GuidedDecodingParams(json=SCHEMA, regex="a"), r"exactly one of .* got \['json', 'regex'\]"),
    (lambda: GuidedDecodingParams(json="{not json"), "not valid JSON"),
    (lambda: GuidedDecodingParams(json=42), "must be a dict"),
    (lambda: GuidedDecodingParams(choice=[]), "non-empty list"),
    (lambda: GuidedDecodingParams(regex="a", backend="nope"), "backend='nope'"),
    (lambda: SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"}), "not both"),
    (lambda: SamplingParams(guided_decoding="a"), "must be a GuidedDecodingParams"),
    (lambda: GenerationConfig(response_format={"type": "xml"}), "response_format must be"),
    (lambda: GenerationConfig(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "'schema'"),
])
def test_bad_guided_parameters_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_grammar_and_structural_tag_are_guides_of_their_own():
    assert GuidedDecodingParams(grammar="root ::= 'a'").kind == "grammar"
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}
    assert json.loads(GuidedDecodingParams(structural_tag=tag).structural_tag) == tag  # vLLM's JSON text
    assert from_response_format(tag).kind == "structural_tag"
    with pytest.raises(ValueError, match="grammar must be a non-empty str.*' '"):
        GuidedDecodingParams(grammar=" ")
    with pytest.raises(ValueError, match="structural_tag must be JSON text or a dict, got 3"):
        GuidedDecodingParams(structural_tag=3)


@pytest.mark.parametrize("response_format, kind", [
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, "json"),
    ({"type": "regex_schema", "regex_schema": "call me [A-Za-z]{1,10}"}, "regex"),
    ({"type": "json_object"}, "json_object"),
])
def test_lmdeploy_response_format_maps_onto_guided_decoding(response_format, kind):
    guided = GenerationConfig(response_format=response_format).to_sampling_params().guided_decoding
    assert guided.kind == kind
    assert GenerationConfig(response_format={"type": "text"}).to_sampling_params().guided_decoding is None


def test_a_choice_with_a_nul_character_is_refused_at_once():
    """Review 35: it compiled, and a request whose model began that choice failed mid-way ("no allowed token
    can continue the output"): NUL is the guide's end sentinel, which no token holds."""
    with pytest.raises(ValueError, match=r"guided choice 'a\\x00b' holds a NUL character"):
        GuidedDecodingParams(choice=["a\x00b", "c"])


def test_choices_that_join_alike_are_different_guides():
    """The compiled-guide cache key joined choices with \\x1f: ["a\\x1fb"] and ["a", "b"] shared one guide."""
    assert GuidedDecodingParams(choice=["a\x1fb"]).spec != GuidedDecodingParams(choice=["a", "b"]).spec
