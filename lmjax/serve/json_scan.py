"""A JSON walker for tool calls being written: over a prefix of a reply it finds a call object's top-level
"name" (once its string is complete) and where its "arguments" / "parameters" value starts and (once
complete) ends, minding strings, escapes and nesting. lmjax.serve.tool_stream streams calls with it, and
the parsers take the arguments' text from it (the JSON the model wrote, as streamed)."""
from __future__ import annotations

import dataclasses
import json
import re

_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[^\s,\]}]*")  # a number, true, false or null
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass
class ObjectScan:
    """What a scan found of one call object: `end` past its closing brace (None: not complete yet), its
    name (None: not complete yet), its arguments value's (start, end or None) and first character."""

    end: int | None = None
    name: str | None = None
    args: tuple[int, int | None, str] | None = None


def string_end(text: str, i: int) -> int | None:
    """Past the JSON string starting at text[i] == '"'; None while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at text[i]; None while it is incomplete."""
    if text[i] == '"':
        return string_end(text, i)
    if text[i] not in "{[":
        m = _SCALAR.match(text, i)
        return m.end() if m.end() < len(text) else None  # a number may still grow
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            j = string_end(text, j)
            if j is None:
                return None
            continue
        depth += c in "{["
        depth -= c in "}]"
        j += 1
        if depth == 0:
            return j
    return None


def scan_object(text: str, p: int) -> ObjectScan:
    """Scan the object starting at text[p] == '{' (ValueError where it is not JSON)."""
    scan, i = ObjectScan(), p + 1
    while True:
        i = _WS.match(text, i).end()
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise ValueError(f"not a JSON object key at {i}")
        key_end = string_end(text, i)
        colon = _WS.match(text, key_end).end() if key_end is not None else len(text)
        if colon >= len(text):
            return scan
        if text[colon] != ":":
            raise ValueError(f"no ':' after a key at {colon}")
        key, start = json.loads(text[i:key_end]), _WS.match(text, colon + 1).end()
        if start >= len(text):
            return scan
        end = value_end(text, start)
        if key == "name" and text[start] == '"' and end is not None:
            scan.name = json.loads(text[start:end])
        elif key in ARGUMENT_KEYS:
            scan.args = (start, end, text[start])
        if end is None:
            return scan
        i = end


def scan_calls(text: str, first: int, gap: re.Pattern) -> list[ObjectScan]:
    """The call objects from text[first] on, each after the previous one and the parser's `gap`."""
    scans, p = [], first
    while True:
        scan = scan_object(text, p)
        scans.append(scan)
        m = gap.match(text, scan.end) if scan.end is not None else None
        if m is None:
            return scans
        p = m.end()
