"""A JSON walker for tool calls being written: over a prefix of a reply it finds a call object's top-level
"name" (once its string is complete) and where its "arguments" / "parameters" value starts and (once
complete) ends, minding strings, escapes and nesting. lmjax.serve.tool_stream streams calls with it, and
the parsers take the arguments' text from it (the JSON the model wrote, as streamed).

Of duplicate keys the scan keeps the first "name" and the first arguments key ("arguments" or "parameters",
whichever comes first): a stream sends those as it meets them and cannot take them back when a later one
comes, so the finished reply takes the same ones (json.loads would keep the last).

The walk is incremental (`CallScanner`): it stops where the text so far ends, inside a string or nesting,
and goes on from there when more comes, so streaming a long call costs its length, not its length squared.
"""
from __future__ import annotations

import dataclasses
import json
import re

_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[^\s,\]}]*")  # a number, true, false or null
_STRING_RUN = re.compile(r'[^"\\]*')  # a string's characters up to a quote or an escape (skipped by re)
_NESTED_RUN = re.compile(r'[^"{}\[\]]*')  # inside an object or array, up to what opens, closes or quotes
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass
class ObjectScan:
    """What a scan found of one call object: `end` past its closing brace (None: not complete yet), its
    name (None: not complete yet, or not a string), its arguments value's (start, end or None) and first
    character."""

    end: int | None = None
    name: str | None = None
    args: tuple[int, int | None, str] | None = None


class _Walk:
    """Generators over `self.text`, a text that grows: where one needs a character not written yet it yields,
    and the caller resumes it once `self.text` is longer, from the same place (positions, depth: its locals)."""

    def __init__(self, text: str = ""):
        self.text = text

    def _ws(self, i: int):
        """Past the whitespace at text[i]: the position of the next character."""
        while (i := _WS.match(self.text, i).end()) >= len(self.text):
            yield
        return i

    def _string(self, i: int):
        """Past the JSON string starting at text[i] == '"'."""
        i += 1
        while True:
            if i < len(self.text):  # (past the end: after a backslash whose escaped character is not written yet)
                i = _STRING_RUN.match(self.text, i).end()
            if i >= len(self.text):
                yield
            elif self.text[i] == '"':
                return i + 1
            else:
                i += 2  # a backslash and the character it escapes

    def _nested(self, i: int):
        """Past the object or array starting at text[i]."""
        depth = 0
        while True:
            if i < len(self.text):
                i = _NESTED_RUN.match(self.text, i).end()
            if i >= len(self.text):
                yield
                continue
            if self.text[i] == '"':
                i = yield from self._string(i)
                continue
            depth += 1 if self.text[i] in "{[" else -1
            i += 1
            if depth == 0:
                return i

    def _value(self, i: int):
        """Past the JSON value starting at text[i]; a number ends only at the character after it (it may grow)."""
        if self.text[i] == '"':
            return (yield from self._string(i))
        if self.text[i] in "{[":
            return (yield from self._nested(i))
        while (i := _SCALAR.match(self.text, i).end()) >= len(self.text):
            yield
        return i

    def _object(self, p: int, scan: ObjectScan):
        """Fill `scan` from the object starting at text[p] == '{' (ValueError where it is not JSON)."""
        i, named = p + 1, False
        while True:
            i = yield from self._ws(i)
            if self.text[i] == "}":
                scan.end = i + 1
                return
            if self.text[i] == ",":
                i += 1
                continue
            if self.text[i] != '"':
                raise ValueError(f"not a JSON object key at {i}")
            key_end = yield from self._string(i)
            colon = yield from self._ws(key_end)
            if self.text[colon] != ":":
                raise ValueError(f"no ':' after a key at {colon}")
            key = json.loads(self.text[i:key_end])
            start = yield from self._ws(colon + 1)
            first_args = key in ARGUMENT_KEYS and scan.args is None
            if first_args:  # its start is known before its end: a stream sends it as it grows
                scan.args = (start, None, self.text[start])
            i = yield from self._value(start)
            if first_args:
                scan.args = (start, i, self.text[start])
            if key == "name" and not named:
                named = True
                scan.name = json.loads(self.text[start:i]) if self.text[start] == '"' else None


def scan_object(text: str, p: int) -> ObjectScan:
    """Scan the object starting at text[p] == '{' as far as the text goes (ValueError where it is not JSON)."""
    scan = ObjectScan()
    next(_Walk(text)._object(p, scan), None)  # runs to the object's end or to where the text ends
    return scan


class CallScanner(_Walk):
    """The call objects of a growing reply from text[first] on, each after the previous one and the parser's
    `gap`: `scan(text)` walks only what was added since the last call (the text must only grow)."""

    def __init__(self, first: int, gap: re.Pattern):
        super().__init__()
        self.scans: list[ObjectScan] = []
        self.error: str | None = None  # where the text is not JSON: it stays so as the text grows
        self._walk = self._calls(first, gap)

    def scan(self, text: str) -> list[ObjectScan]:
        """The scans so far, the last one possibly incomplete; ValueError once the text is not JSON."""
        if self.error is None:
            self.text = text
            try:
                next(self._walk)
            except ValueError as e:
                self.error = str(e)
        if self.error is not None:
            raise ValueError(self.error)
        return self.scans

    def _calls(self, first: int, gap: re.Pattern):
        p = first
        while True:
            scan = ObjectScan()
            self.scans.append(scan)
            yield from self._object(p, scan)
            while (m := gap.match(self.text, scan.end)) is None:  # the next call's marker may be coming
                yield
            p = m.end()
