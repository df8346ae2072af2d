"""A request's JSON schema (or json_object) as llguidance's grammar (vLLM's "guidance" backend; lmjax's JSON
guides were outlines-core regexes until session 28, which let invalid JSON through for `{}` subschemas and
allOf, ignored `not` and number bounds, and grew exponentially with nesting and optional properties).

lmjax writes JSON as it always has: between tokens the whitespace of `whitespace` (None: one optional space,
outlines-core's default; "": none; else the given pattern), and an object only with the properties its schema
names where the schema does not say otherwise (additionalProperties false where it is absent, as xgrammar's
strict default and outlines-core do; an explicit additionalProperties true or schema is honoured; never on a
subschema JSON Schema intersects with siblings: allOf parts, anyOf / oneOf branches beside properties, $ref
targets). Keywords llguidance does not enforce are refused by name before it sees them."""
from __future__ import annotations

import json
import re
import string

from lmjax.engine.guided_regex import narrowed_class

# keys whose values are data, not subschemas ("discriminator": pydantic's tag -> $ref map, whose tags may be any
# words, "not" and "if" among them); vendor extensions ("x-...") likewise
_NOT_SCHEMAS = {"const", "enum", "default", "examples", "discriminator"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}  # names (patterns) to subschemas
# Keywords llguidance (1.9) does not enforce ("Unimplemented keys"): refused by name, as vLLM refuses what its
# backend cannot enforce, not ignored (a guide would let JSON through that breaks them).
UNSUPPORTED_KEYWORDS = {"uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "not",
                        "dependentRequired", "dependentSchemas", "if", "then", "else"}
DEFAULT_WHITESPACE = r"[ ]?"  # outlines-core's default between JSON tokens, which lmjax has always written


def schema_nodes(schema):
    """Every subschema of `schema` (itself included), at any depth (property names are not keywords)."""
    if isinstance(schema, list):
        for value in schema:
            yield from schema_nodes(value)
    elif isinstance(schema, dict):
        yield schema
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    yield from schema_nodes(sub)
            elif key not in _NOT_SCHEMAS and not key.startswith("x-"):
                yield from schema_nodes(value)


def check_schema(schema) -> None:
    """A ValueError naming the keywords of `schema` (at any depth) that the guide cannot enforce, or a `type`
    that is neither a string nor a list of strings."""
    nodes = list(schema_nodes(schema))
    found = {key for node in nodes for key in node if key in UNSUPPORTED_KEYWORDS}
    if found:
        raise ValueError(f"JSON schema keywords {sorted(found)} are not supported by guided decoding (the guide "
                         "could not enforce them)")
    for node in nodes:
        types = node.get("type")
        if types is not None and not (isinstance(types, str) or isinstance(types, list)
                                      and all(isinstance(t, str) for t in types)):
            raise ValueError(f"JSON schema \"type\" must be a string or a list of strings, got {types!r}")


def _local_ref(schema, ref) -> dict | None:
    """The subschema a local "#/..." $ref points to, or None."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _open_parts(schema, nodes: list[dict]) -> set[int]:
    """ids of the subschemas that describe part of an object, each intersected with others (JSON Schema's
    reading of siblings): allOf branches, anyOf / oneOf branches of an object that has properties of its own,
    the target of a $ref beside properties, and the $ref targets of all of these. Closing one to its own
    properties would forbid the others'."""
    parts: list = []
    for node in nodes:
        own = any(k in node for k in ("properties", "patternProperties", "required"))
        for key in ("allOf", "anyOf", "oneOf") if own else ("allOf",):
            parts += [b for b in _as_list(node.get(key)) if isinstance(b, dict)]
        if own and "$ref" in node:
            parts.append({"$ref": node["$ref"]})
    ids = {id(part) for part in parts}
    ids |= {id(target) for part in parts if (target := _local_ref(schema, part.get("$ref"))) is not None}
    return ids


def _as_list(value) -> list:
    return value if isinstance(value, list) else []


def close_objects(schema) -> None:
    """additionalProperties false, in place, on each object subschema that names its properties and does not
    say: not on allOf parts, objects composed of others (allOf / anyOf / oneOf / $ref beside properties) or
    objects that require a property they do not declare."""
    nodes = list(schema_nodes(schema))
    parts = _open_parts(schema, nodes)
    for node in nodes:
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        named = "properties" in node or "patternProperties" in node  # ({"properties": {}}: the empty object)
        composed = id(node) in parts or any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref"))
        undeclared = isinstance(node.get("required"), list) and any(r not in declared for r in node["required"])
        if named and not composed and not undeclared and "additionalProperties" not in node:
            node["additionalProperties"] = False


# Characters a whitespace pattern must not match: JSON allows only space, tab, LF and CR between tokens
_NOT_JSON_SPACE = "".join(sorted(set(string.printable) - set(" \t\n\r"))) + "\u00a0\u0085\u2028\u3000"


def json_whitespace(pattern: str) -> str:
    """A whitespace_pattern (vLLM's guided_whitespace_pattern) as JSON can take it: `\\s` is JSON's four
    whitespace characters (llguidance's Rust regex reads it as Unicode's: a U+3000 between tokens made a "stop"
    output json.loads refuses), and a pattern matching anything else is a ValueError naming it."""
    narrowed = narrowed_class(pattern, "s", " \\t\\n\\r")
    try:
        matched = [c for c in _NOT_JSON_SPACE if re.fullmatch(narrowed, c)]
    except re.error:  # syntax Python's re lacks: llguidance judges the pattern itself
        return narrowed
    if matched:
        raise ValueError(f"whitespace_pattern {pattern!r} matches {matched[0]!r}: JSON allows only space, tab, "
                         "newline and carriage return between its tokens")
    return narrowed


def json_grammar(llguidance, schema, whitespace: str | None) -> str:
    """llguidance's grammar for `schema` (a parsed JSON schema, changed in place) written with `whitespace`."""
    check_schema(schema)
    close_objects(schema)
    options = {"whitespace_flexible": False} if whitespace == "" else \
        {"whitespace_pattern": DEFAULT_WHITESPACE if whitespace is None else json_whitespace(whitespace)}
    try:
        text = json.dumps(schema, allow_nan=False)
    except ValueError as e:  # Infinity / NaN, which Python's JSON reads and llguidance's does not
        raise ValueError(f"JSON schema numbers must be finite ({e})") from e
    return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)
