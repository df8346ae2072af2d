"""JSON schema keywords the guide cannot enforce (uniqueItems, contains, propertyNames, dependentRequired,
if/then, not, ...) are refused by name (probe 24): the guide let JSON through that breaks them; those llguidance
enforces (multipleOf, patternProperties, min/maxProperties, number bounds) hold. Integer minimum / maximum hold
also when `type` is a list (["integer", "null"]). Schemas outlines-core (JSON's backend until session 28) got
wrong are held to the schema (probe 28)."""
import json
import string

import jsonschema
import pytest

from lmjax import GuidedDecodingParams, SamplingParams
from lmjax.engine.guided import GuidedDecoding
from char_tokenizer import CharTokenizer

CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]


@pytest.fixture(scope="module")
def guided():
    return GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])


def _completes(guided, params, text) -> bool:
    """Whether the guide lets `text` be written in full and then end."""
    state = guided.new_state(params, None)
    for c in text:
        t = CHARS.index(c) + 1
        if not (state.mask_W()[t >> 5] >> (t & 31)) & 1:
            return False
        if state.advance(t) == "stop":
            return True
    return bool(state.mask_W()[0] & 1)  # EOS allowed: the output may end here


@pytest.mark.parametrize("keyword, schema, invalid", [
    ("multipleOf", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]},
     '{"n":7}'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"x1":"s"}'),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 1},
                       "additionalProperties": {"type": "integer"}}, '{"abc":1}'),
    ("maxProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     '{"a":1,"b":2}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    ("if", {"type": "object", "properties": {"n": {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}},
            "required": ["n"]}, '{"n":7}'),
])
def test_unenforced_keyword_is_refused_or_honoured(guided, keyword, schema, invalid):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(invalid), schema)  # the text really violates the schema
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))
    try:
        guided.check(params)
    except ValueError as e:
        assert keyword in str(e), f"refused, but the message does not name {keyword!r}: {e}"
        return
    assert not _completes(guided, params, invalid), f"{keyword} silently ignored: the guide accepts {invalid}"


def test_integer_bounds_hold_when_type_is_a_list(guided):
    """README: integer minimum / maximum are enforced. `_bounded_integers` only looks at type == "integer";
    {"type": ["integer", "null"], "minimum": 5} (an optional bounded field) lets 1 through."""
    schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 5, "maximum": 9}},
              "required": ["n"]}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))
    guided.check(params)
    assert _completes(guided, params, '{"n":7}') and _completes(guided, params, '{"n":null}')
    assert not _completes(guided, params, '{"n":1}')


@pytest.mark.parametrize("schema, valid, invalid", [
    ({"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5, "maximum": 2.5}}, "required": ["x"]},
     ['{"x":1.5}', '{"x":2.5}', '{"x":0.5}', '{"x":2}'], ['{"x":3}', '{"x":0.25}', '{"x":2.51}', '{"x":-1}']),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, ["0.5", "0.999"], ["0", "1", "1.5"]),
    ({"type": "integer", "multipleOf": 5}, ["15", "0", "-5"], ["7", "16"]),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
     ['{"x1":2}', "{}"], ['{"x1":"s"}', '{"y":1}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     ['{"a":1}'], ['{"a":1,"b":2}']),
])
def test_what_outlines_cannot_enforce_llguidance_does(guided, schema, valid, invalid):
    """Number bounds were silently not enforced; multipleOf, patternProperties, min/maxProperties were refused: a
    schema using them is guided by llguidance (vLLM's guidance backend), which holds the output to them."""
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))
    guided.check(params)
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
        assert _completes(guided, params, text), text
    for text in invalid:
        assert not _completes(guided, params, text), text


def test_llguidance_json_keeps_outlines_whitespace_and_declared_properties(guided):
    schema = {"type": "object", "properties": {"x": {"type": "number", "maximum": 9}}, "required": ["x"]}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))  # the default: one optional space
    assert _completes(guided, params, '{"x": 1.5}') and _completes(guided, params, '{"x":1.5}')
    assert not _completes(guided, params, '{"x":  1.5}')
    assert not _completes(guided, params, '{"x": 1, "y": 2}')  # no undeclared property, as outlines writes JSON
    lines = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema, whitespace_pattern=r"[\n ]*"))
    assert _completes(guided, lines, '{\n  "x": 2\n}')


def _tight(schema):
    return SamplingParams(guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))


BASE = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {"x": {"type": "number"}},
                                             "required": ["x"]}]}


@pytest.mark.parametrize("schema, valid, invalid", [
    # outlines-core wrote {} as an ungrouped alternation: the whole guide let bare values through (probe 28)
    ({"type": "object", "properties": {"name": {"type": "string"}, "args": {}}, "required": ["name", "args"]},
     ['{"name":"f","args":{"x":1}}', '{"name":"f","args":[1]}'], ["645", "null", "[true]", '{"name":"f"}']),
    # outlines-core concatenated allOf's branches ({"id":1}{"x":2}); a $ref branch stays open to its siblings
    (BASE, ['{"id":1,"x":2}'], ['{"id":1}{"x":2}', '{"id":1}']),
    # a required property the schema does not declare: outlines-core dropped it
    ({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a", "b"]},
     ['{"a":1,"b":2}'], ['{"a":1}']),
    # additionalProperties true beside properties is honoured (outlines-core refused the extras)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a":1,"b":"x"}', '{"a":1}'], ['{"a":"x"}']),
])
def test_json_schemas_outlines_got_wrong_are_held_to_the_schema(guided, schema, valid, invalid):
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
        assert _completes(guided, _tight(schema), text), text
    for text in invalid:
        assert not _completes(guided, _tight(schema), text), text


def test_a_pydantic_any_field_is_guided(guided):
    from typing import Any

    from pydantic import BaseModel

    class M(BaseModel):
        data: Any
        n: int

    params = _tight(M.model_json_schema())  # {"title": "Data"}: outlines-core refused it
    guided.check(params)
    assert _completes(guided, params, '{"data":[1,"a"],"n":2}') and not _completes(guided, params, '{"n":2}')


@pytest.mark.parametrize("schema", [{"type": "integer", "not": {"const": 5}},
                                    {"type": "object", "properties": {"s": {"not": {"enum": ["x"]}}}}])
def test_not_is_refused_by_name(guided, schema):
    with pytest.raises(ValueError, match=r"keywords \['not'\] are not supported"):
        guided.check(_tight(schema))


def test_a_discriminator_mapping_is_data_not_keywords(guided):
    """pydantic's discriminated union: its tags ("not", "contains") are mapping keys, not schema keywords
    (probe 28: the schema was refused naming them)."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, Field

    class Not(BaseModel):
        op: Literal["not"]
        arg: str

    class Contains(BaseModel):
        op: Literal["contains"]
        arg: str

    class Query(BaseModel):
        filter: Annotated[Union[Not, Contains], Field(discriminator="op")]

    params = _tight(Query.model_json_schema())
    guided.check(params)
    assert _completes(guided, params, '{"filter":{"op":"not","arg":"x"}}')
    assert not _completes(guided, params, '{"filter":{"op":"if","arg":"x"}}')


def test_tool_choice_required_keeps_the_tools_defs_reachable(guided):
    """Each tool's parameters' $defs move to the forced schema's root, where "#/$defs/..." points (vLLM's); a name
    two tools define differently is a ValueError (probe 28: "Pointer '/$defs/Loc' does not exist")."""
    from lmjax.serve.tool_parsers import forced_tool_schema

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    weather = {"$defs": {"Loc": loc}, "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
               "required": ["loc"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": weather}},
             {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}]
    params = _tight(forced_tool_schema(tools, None))
    guided.check(params)
    assert _completes(guided, params, '[{"name":"weather","parameters":{"loc":{"city":"Paris"}}}]')
    assert not _completes(guided, params, '[{"name":"weather","parameters":{"loc":{"town":"Paris"}}}]')
    clash = {**weather, "$defs": {"Loc": {"type": "string"}}}
    with pytest.raises(ValueError, match=r"\$defs\['Loc'\] differently"):
        forced_tool_schema(tools + [{"type": "function", "function": {"name": "other", "parameters": clash}}], None)


@pytest.mark.parametrize("schema, text", [
    # "base + variants": the parent's property beside anyOf branches that add their own (probe 28: unsatisfiable)
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"kind":"x","a":1}'),
    # the same with "kind" optional (probe 28: every object with "kind" silently refused)
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"kind":"x","b":2}'),
    # $ref beside properties (draft 2019+): the referenced base and the node's own properties together
    ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "$ref": "#/$defs/Base", "properties": {"note": {"type": "string"}}, "required": ["note"]}, '{"id":1,"note":"n"}'),
])
def test_an_object_composed_of_siblings_takes_all_their_properties(guided, schema, text):
    jsonschema.validate(json.loads(text), schema)
    params = _tight(schema)
    guided.check(params)
    assert _completes(guided, params, text)
