"""Tool-call parsers: a model's finished reply text -> (content before the calls or None, [ToolCall]).

The server picks one by name (`--tool-call-parser NAME`, `get_tool_parser`):
- `hermes` (Qwen2.5, Qwen3; aliases `qwen2d5` and `qwen3`, LMDeploy's names for them, and `qwen`, which
  LMDeploy has had for Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several in a row; the
  text before the first is the content.
- `llama3` (alias `llama3_json`, vLLM's name): a reply that is JSON objects `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`. Text before `<|python_tag|>` is the content; a
  reply that does not start with `{` or the tag is plain content.
- `internlm` (InternLM2.5; alias `intern-s1`, LMDeploy's name for Intern-S1, which writes calls the same way):
  `<|action_start|><|plugin|>{json}<|action_end|>`, the content before it.

As in vLLM, a reply whose calls do not parse (bad JSON, no name) is returned whole as content: a model's
malformed call is the model's answer, never a server error.

Streaming (lmjax.serve.tool_stream.ToolStream): content goes out as it comes until a call may be starting;
text that could be the beginning of a start marker (and trailing whitespace, which the non-streaming content
drops before a call) is held back. Calls stream as the model writes them (`stream_first`, `stream_gap`: where
they begin and what separates them). At the end the whole text is parsed as above, so a stream and a
non-streaming reply agree. A call's `arguments` is the JSON text the model wrote for them (an object or
array; vLLM re-serializes it), so the streamed pieces add up to it; other values are serialized
(`arguments_text`).
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from lmjax.serve.json_scan import scan_object

_NEVER = re.compile(r"(?!)")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON string, as OpenAI's `function.arguments`."""
    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(obj, raw: str | None = None, start: int = 0) -> ToolCall:
    """A ToolCall from a decoded {"name", "arguments" | "parameters"} object; ValueError if it is not one.
    `raw[start:]` holds the object as written: the name and arguments are then its first "name" and first
    arguments key's (json_scan: what a stream sent, also of duplicate keys), the arguments' text kept."""
    if not isinstance(obj, dict):
        raise ValueError(f"not a tool call (not an object): {obj!r}")  # noqa: TRY004 (ValueError: "not a call")
    if raw is None:
        name, written = obj.get("name"), None
        value = obj.get("arguments", obj.get("parameters", {}))
    else:
        scan = scan_object(raw, start)
        name, written = scan.name, raw[scan.args[0]:scan.args[1]] if scan.args is not None else None
        value = json.loads(written) if written is not None else {}
    if not isinstance(name, str) or not name:
        raise ValueError(f"not a tool call (no 'name' string): {obj!r}")
    return ToolCall(name, arguments_text(value, written))


def arguments_text(value, written: str | None = None) -> str:
    """`function.arguments` of a call whose arguments decoded to `value` (`written`: as the model wrote them).
    Always JSON text, for the client's json.loads and for the round trip (tokenizer._with_dict_arguments): a
    string is kept only if it holds an object (arguments written as a JSON string, a common way), else
    serialized as vLLM does ("Paris" -> '"Paris"'); an object or array keeps the model's text, which a stream
    sends piece by piece (ToolStream: it streams only those, anything else goes out whole at the end)."""
    if isinstance(value, str):
        try:
            holds_object = isinstance(json.loads(value), dict)
        except ValueError:
            holds_object = False
        return value if holds_object else json.dumps(value, ensure_ascii=False)
    if written is not None and written[:1] in ("{", "["):
        return written
    return json.dumps(value, ensure_ascii=False)


_NON_SPACE = re.compile(r"\S")


def _may_open_a_call(text: str, marker: str) -> bool:
    """Whether the reply so far (Llama 3's) may still be a bare JSON call or the start of `marker`: it is
    blank, opens with '{', or is a beginning of the marker."""
    m = _NON_SPACE.search(text)
    return m is None or text[m.start()] == "{" or (len(text) - m.start() < len(marker)
                                                    and marker.startswith(text[m.start():]))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (it may yet become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base of the parsers. `parse` is the contract; `content_end` serves streaming."""
    name = ""
    start_marker = ""  # where a call begins; text before it is content
    calls_finish_reason = "tool_calls"  # a reply's finish_reason when it holds calls (vLLM's, for "auto")
    stream_gap = _NEVER  # what separates one call object from the next (ending where the next begins)
    stream_name: str | None = None  # the calls' name when the reply does not say it (a forced function)
    stream_needs_args = False  # a call streams only once its arguments key is seen (JSON that may be content)
    stream_opener: re.Pattern | None = None  # the first call's marker, ending where its object begins

    def stream_first(self, text: str, since: int = 0) -> int | None:
        """Where the first call object ('{') begins in the text so far; None: no call to stream (yet).
        `since`: how much of the text went out as content, which holds no call (the search starts there, so a
        long reply's feeds do not search it all again each time)."""
        m = self.stream_opener.search(text, since) if self.stream_opener is not None else None
        return m.end() if m else None

    def stream_args(self, text: str, first: int, scan) -> tuple[int, int | None] | None:
        """The arguments' span to stream of a scanned call (object or array values only)."""
        if scan.args is None or scan.args[2] not in "{[":
            return None
        return scan.args[0], scan.args[1]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); no calls -> (text, [])."""
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        try:
            calls = self._calls(text[start:])
        except ValueError:  # json.JSONDecodeError is one
            return text, []
        if not calls:
            return text, []
        return text[:start].rstrip() or None, calls

    def _calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def content_end(self, text: str, since: int = 0) -> int:
        """How much of the text so far is surely content (may be streamed now): everything before a start
        marker, or before an end that could grow into one, less trailing whitespace; at least `since` (what
        went out already, which holds no marker, nor ends in whitespace)."""
        start = text.find(self.start_marker, since)
        end = start if start >= 0 else len(text) - _held_prefix(text, self.start_marker)
        return since + len(text[since:max(end, since)].rstrip())


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    stream_gap = re.compile(r"\s*</tool_call>\s*<tool_call>\s*(?=\{)")
    stream_opener = re.compile(r"<tool_call>\s*(?=\{)")

    def _calls(self, text: str) -> list[ToolCall]:
        """Each `<tool_call>` holds one JSON object, then `</tool_call>` (or the end of the reply). The JSON is
        decoded from the marker on, so an argument string that holds "</tool_call>" (code, markup) is still
        part of it. As vLLM: text between or after the calls is dropped (the calls are the reply)."""
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while (start := text.find(self.start_marker, pos)) >= 0:
            body = start + len(self.start_marker)
            body += len(text[body:]) - len(text[body:].lstrip())
            obj, end = decoder.raw_decode(text, body)
            calls.append(call_from_json(obj, text, body))
            rest = text[end:].lstrip()
            if rest.startswith(self.end_marker):
                pos = len(text) - len(rest) + len(self.end_marker)
            elif rest:
                raise ValueError(f"text inside <tool_call> after the call: {rest[:40]!r}")
            else:
                break
        return calls


class InternLMParser(ToolParser):
    name = "internlm"
    start_marker = "<|action_start|>"
    _CALL = re.compile(r"<\|action_start\|>\s*<\|plugin\|>(.*?)(?:<\|action_end\|>|$)", re.DOTALL)
    stream_gap = re.compile(r"\s*<\|action_end\|>\s*<\|action_start\|>\s*<\|plugin\|>\s*(?=\{)")
    stream_opener = re.compile(r"<\|action_start\|>\s*<\|plugin\|>\s*(?=\{)")

    def _calls(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._CALL.finditer(text):
            body = m.group(1)
            calls.append(call_from_json(json.loads(body), body, len(body) - len(body.lstrip())))
        if text.count(self.start_marker) != len(calls):  # an <|interpreter|> action or a broken one
            raise ValueError("an action that is not a plugin call")
        return calls


class Llama3Parser(ToolParser):
    name = "llama3"
    start_marker = "<|python_tag|>"
    stream_gap = re.compile(r"\s*;\s*(?=\{)")
    stream_needs_args = True  # {"name": "Alice", "age": 30} is an answer, not a call

    def stream_first(self, text: str, since: int = 0) -> int | None:
        tag = text.find(self.start_marker, since)
        if tag < 0 and since:
            return None  # content went out: the reply is no bare JSON call
        m = _NON_SPACE.search(text, tag + len(self.start_marker) if tag >= 0 else 0)
        return m.start() if m and text[m.start()] == "{" else None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        tag = text.find(self.start_marker)
        before, body = (text[:tag], text[tag + len(self.start_marker):]) if tag >= 0 else ("", text)
        if tag < 0 and not text.lstrip().startswith("{"):
            return text, []
        try:
            calls = self._json_calls(body)
        except ValueError:
            return text, []
        return before.rstrip() or None, calls

    @staticmethod
    def _json_calls(body: str) -> list[ToolCall]:
        """JSON objects separated by `;` (and whitespace), nothing else."""
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            pos = start = len(body) - len(body[pos:].lstrip())
            obj, pos = decoder.raw_decode(body, pos)
            if not isinstance(obj, dict) or not ("parameters" in obj or "arguments" in obj):
                # a JSON answer that merely has a "name" ({"name": "Alice", "age": 30}) is content (vLLM's too)
                raise ValueError(f"not a tool call (no 'parameters'): {obj!r}")
            calls.append(call_from_json(obj, body, start))
            rest = body[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                raise ValueError(f"text after a tool call: {rest[:40]!r}")
            pos = len(body) - len(rest) + 1
            if not body[pos:].strip():  # a trailing `;`
                return calls

    def content_end(self, text: str, since: int = 0) -> int:
        tag = text.find(self.start_marker, since)
        if tag >= 0:
            return since + len(text[since:tag].rstrip())
        if not since and _may_open_a_call(text, self.start_marker):
            return 0  # a call may be starting: it is the whole reply or nothing
        end = len(text) - _held_prefix(text, self.start_marker)
        return since + len(text[since:max(end, since)].rstrip())


class ForcedToolParser(ToolParser):
    """tool_choice "required" or a named function: the reply was guided to JSON (`forced_tool_schema`), so
    it is all calls, parsed when complete (an unfinished one, cut by max_tokens, is plain content). As in
    OpenAI and vLLM, "required" finishes with "tool_calls" and a named function with "stop"; a named function's
    reply is its arguments."""

    def __init__(self, function: str | None):
        self.function = function  # None: "required", the reply is [{"name", "parameters"}, ...]
        self.calls_finish_reason = "tool_calls" if function is None else "stop"
        self.stream_name = function  # a named function's reply streams as its arguments; "required" whole

    def stream_first(self, text: str, since: int = 0) -> int | None:
        m = _NON_SPACE.search(text)
        return m.start() if self.function is not None and m and text[m.start()] == "{" else None

    def stream_args(self, text: str, first: int, scan) -> tuple[int, int | None]:
        return first, scan.end  # the whole reply is the arguments

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            value = json.loads(text)
            if self.function is not None:
                calls = [ToolCall(self.function, text)] if isinstance(value, dict) else []
            else:
                calls = [call_from_json(obj) for obj in value] if isinstance(value, list) else []
        except ValueError:  # an output cut short
            return text, []
        return (None, calls) if calls else (text, [])

    def content_end(self, text: str, since: int = 0) -> int:
        return 0  # the reply is the calls: nothing streams as content


class SingleCall:
    """parallel_tool_calls=false: `parser` keeping only the first call (vLLM's maybe_filter_parallel_tool_calls);
    ToolStream streams no call past `max_calls`."""
    max_calls = 1

    def __init__(self, parser: ToolParser):
        self.parser = parser

    def __getattr__(self, name: str):
        return getattr(self.parser, name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.parser.parse(text)
        return content, calls[:1]


def forced_tool_schema(tools: list[dict], function: str | None, single: bool = False) -> dict:
    """The JSON schema a forced reply is guided by: the named function's parameters, or (tool_choice
    "required") a non-empty array of {"name": one of the tools, "parameters": its parameters} (vLLM's), each
    tool's $defs moved to the root, where its "#/$defs/..." references point (pydantic's and most SDKs'
    nested argument models); one name defined two ways by two tools is a ValueError."""
    def params(tool):
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    if function is not None:
        return params(next(t for t in tools if t["function"]["name"] == function))
    defs: dict = {}
    options = []
    for tool in tools:
        parameters = dict(params(tool))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs[{name!r}] differently: the forced call's schema cannot hold both")
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                        "parameters": parameters},
                        "required": ["name", "parameters"]})
    forced = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options},
              **({"maxItems": 1} if single else {})}  # (parallel_tool_calls=false)
    return {**forced, "$defs": defs} if defs else forced


# the names vLLM and LMDeploy give these formats (`--tool-call-parser`; lmjax.cli.TOOL_CALL_PARSERS spells them out)
PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser, "qwen2d5": HermesParser,
                                        "qwen3": HermesParser, "llama3": Llama3Parser, "llama3_json": Llama3Parser,
                                        "internlm": InternLMParser, "intern-s1": InternLMParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}") from None
