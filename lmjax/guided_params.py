"""Structured outputs (guided decoding) as a request asks for them: vLLM's `GuidedDecodingParams` (its newer
name `StructuredOutputsParams` is the same class here) and LMDeploy's / OpenAI's `response_format` dict.

Plain data, checked for shape on creation (one kind of guide, a JSON schema that parses, a non-empty
choice list). Whether a schema or regex can actually constrain the model's vocabulary is known only once
the engine compiles it (lmjax.engine.guided): an error there is a ValueError naming the spec, raised when
the request is submitted. Import-light on purpose: lmjax.config imports this module.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's backend names: lmjax guides JSON, grammars and structural tags with llguidance and regexes and choices
# with outlines-core (lmjax.engine.guided), whichever backend a request names.
BACKENDS = (None, "auto", "outlines", "xgrammar", "guidance", "lm-format-enforcer")


def _fail(message: str):
    raise ValueError(message)


@dataclass
class GuidedDecodingParams:
    """Exactly one of json (a JSON schema: dict, JSON string or pydantic model class), regex, choice (the
    output is one of these strings), grammar (a context-free grammar in EBNF, llama.cpp's GBNF as in vLLM's
    xgrammar examples, or in Lark syntax), json_object (any JSON object), structural_tag (vLLM's JSON text:
    {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in
    which each structure's JSON arguments are guided once its trigger appears) must be set.
    whitespace_pattern: the regex of the whitespace allowed between JSON tokens (lmjax's default: one
    optional space); disable_any_whitespace: none at all (both for json and json_object)."""
    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if self._given(k)]
        if len(given) != 1:
            _fail(f"guided decoding needs exactly one of {list(KINDS)}, got {given or 'none'}")
        if self.backend not in BACKENDS:
            _fail(f"guided decoding backend={self.backend!r} is not one of {[b for b in BACKENDS if b]}")
        if self.json is not None:
            self.json = _schema_text(self.json)
        if self.regex is not None and not isinstance(self.regex, str):
            _fail(f"guided regex must be a str, got {self.regex!r}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            _fail(f"guided grammar must be a non-empty str (EBNF or Lark), got {self.grammar!r}")
        if isinstance(self.structural_tag, dict):  # vLLM takes JSON text; its dict is the same thing
            self.structural_tag = json.dumps(self.structural_tag)
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            _fail(f"structural_tag must be JSON text or a dict, got {self.structural_tag!r}")
        if self.choice is not None:
            choice = list(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                _fail(f"guided choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            nul = next((c for c in choice if "\x00" in c), None)  # (the guide's END sentinel: no token holds it)
            if nul is not None:
                _fail(f"guided choice {nul!r} holds a NUL character, which no token can spell")
            self.choice = choice
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            _fail(f"whitespace_pattern must be a str, got {self.whitespace_pattern!r}")

    @classmethod
    def from_optional(cls, json=None, regex=None, choice=None, grammar=None, json_object=None, **kwargs):
        """None when no kind of guide is given (vLLM's helper of the same name)."""
        if all(v is None for v in (json, regex, choice, grammar, json_object, kwargs.get("structural_tag"))):
            return None
        return cls(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object, **kwargs)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._given(k))

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)  # json_object=False is "not this kind" (the JSON schema false is a schema)
        return value is not None and not (kind == "json_object" and value is False)

    @property
    def spec(self) -> str:
        """What the guide is compiled from, as text (the cache key with `kind` and the whitespace)."""
        value = getattr(self, self.kind)
        return json.dumps(value) if self.kind == "choice" else str(value)  # (a list: no separator to collide)

    @property
    def whitespace(self) -> str | None:
        return "" if self.disable_any_whitespace else self.whitespace_pattern


StructuredOutputsParams = GuidedDecodingParams  # vLLM >= 0.11's name for the same parameters


def _schema_text(schema) -> str:
    """A JSON schema as JSON text; a pydantic model class gives its own schema."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            _fail(f"guided json schema is not valid JSON ({e}): {schema!r}")
    if schema is False:
        _fail("guided json schema false allows no value: nothing can be generated")
    if schema is True:
        schema = {}  # JSON Schema's true: any value, as {}
    if not isinstance(schema, dict):
        _fail(f"guided json schema must be a dict, a JSON string or a pydantic model, got {schema!r}")
    return json.dumps(schema)  # key order kept: the guide writes the properties in the schema's order


def as_guided(guided_decoding, structured_outputs=None) -> GuidedDecodingParams | None:
    """SamplingParams' guided_decoding from it or its alias structured_outputs (at most one set), each None,
    a GuidedDecodingParams or a dict of its fields."""
    if guided_decoding is not None and structured_outputs is not None:
        _fail(f"give guided_decoding or structured_outputs (the same parameters), not both: got "
              f"{guided_decoding!r} and {structured_outputs!r}")
    value = guided_decoding if guided_decoding is not None else structured_outputs
    if value is None or isinstance(value, GuidedDecodingParams):
        return value
    if isinstance(value, dict):
        return GuidedDecodingParams(**value)
    return _fail(f"guided_decoding must be a GuidedDecodingParams or a dict of its fields, got {value!r}")


def from_response_format(response_format: dict | None, whitespace_pattern: str | None = None
                         ) -> GuidedDecodingParams | None:
    """LMDeploy's (and OpenAI's) response_format: {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}}}, {"type": "regex_schema", "regex_schema": "..."}, {"type": "json_object"}, vLLM's
    {"type": "structural_tag", "structures": [...], "triggers": [...]}, or {"type": "text"} (no guide).
    `whitespace_pattern` (vLLM's guided_whitespace_pattern) for the JSON ones."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True, whitespace_pattern=whitespace_pattern)
    if kind == "regex_schema" and isinstance(response_format.get("regex_schema"), str):
        return GuidedDecodingParams(regex=response_format["regex_schema"])
    if kind == "json_schema":
        schema = response_format.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if schema is not None:
            return GuidedDecodingParams(json=schema, whitespace_pattern=whitespace_pattern)
        _fail(f"response_format of type 'json_schema' needs json_schema={{'name': ..., 'schema': {{...}}}}, "
              f"got {response_format!r}")
    if kind == "structural_tag" and "structures" in response_format:  # vLLM's OpenAI server's
        return GuidedDecodingParams(structural_tag=json.dumps(response_format))
    return _fail(f"response_format must be a dict with type 'json_schema', 'regex_schema', 'json_object', "
                 f"'structural_tag' or 'text' (and its fields), got {response_format!r}")
