"""Streaming a reply that a tool-call parser reads (lmjax.serve.tool_parsers): content as it comes, and each
call as OpenAI streams it: a first `delta.tool_calls` entry with the call's index, id, type and name once the
name is complete, then pieces of its `arguments` as the model writes them (vLLM streams them so too).

The arguments streamed are the JSON text the model wrote for them (an object or array value), which is
also what the finished reply's `arguments` holds (`call_from_json(raw=...)`), so the pieces add up to it.
Arguments written as a JSON string, and calls whose name or arguments a scan cannot place, go out whole
when the reply is complete. A call whose name went out and which then turns out malformed stays in the
stream (the finished reply's text is content then, as in a non-streaming reply); vLLM does the same.

The scan (lmjax.serve.json_scan.CallScanner) walks the text so far: it needs no complete JSON, only the
top-level "name" string and where the "arguments" / "parameters" value starts and, once complete, ends. It
walks each piece once (resuming where the last feed stopped) and settled calls are not looked at again, so a
feed costs what it adds: rescanning a long call on every piece made a stream's cost grow with its square.
"""
from __future__ import annotations

import copy
import dataclasses
import uuid

from lmjax.serve.json_scan import CallScanner
from lmjax.serve.tool_parsers import ToolCall, ToolParser


@dataclasses.dataclass
class _Started:
    id: str
    name: str
    args_start: int | None = None  # where its arguments' text begins in the reply (None: none streamed)
    args_sent: int = 0  # and how far it went out: positions, not a copy of the text, which grows on every piece


class ToolStream:
    """One streamed choice: `feed(delta)` -> content that can go out now (`take_call_deltas()` then the
    calls' pieces); `finish()` -> (the rest of the content, calls) once the reply is complete, and
    `final_call_deltas(calls)` what the stream still owes of each call."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.sent = parser, "", 0
        self.max_calls = getattr(parser, "max_calls", None)  # (parallel_tool_calls=false: 1)
        self._started: list[_Started] = []
        self._deltas: list[dict] = []
        self._first: int | None = None  # where the first call begins (fixed once a call went out)
        self._scanner: CallScanner | None = None
        self._settled = 0  # calls complete and fully streamed: not looked at again

    def feed(self, delta: str) -> str:
        text, self.text = self.text, ""  # the one reference left: CPython grows the string in place, where
        text += delta  # `self.text += delta` copied the whole reply every piece (quadratic in a long reply)
        self.text = text
        self._scan()
        end = self.parser.content_end(self.text, self.sent)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def take_call_deltas(self) -> list[dict]:
        deltas, self._deltas = _merged(self._deltas), []
        return self._allowed(deltas)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        content = content or ""
        # what went out is the start of the content (content_end never passes a marker)
        return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls

    def final_call_deltas(self, calls: list[ToolCall]) -> list[dict]:
        """Each call's part not streamed yet: a call not begun goes out whole, a begun one its arguments'
        rest (streamed ids kept)."""
        deltas = list(self._deltas)
        for j, call in enumerate(calls):
            if j >= len(self._started):
                deltas.append({"index": j, **call.to_dict()})
            elif call.arguments.startswith(sent := self._sent_args(self._started[j])):
                rest = call.arguments[len(sent):]
                if rest:
                    deltas.append({"index": j, "function": {"arguments": rest}})
        self._deltas = []
        return self._allowed(_merged(deltas))

    def _allowed(self, deltas: list[dict]) -> list[dict]:
        return deltas if self.max_calls is None else [d for d in deltas if d["index"] < self.max_calls]

    def _sent_args(self, started: _Started) -> str:
        return self.text[started.args_start:started.args_sent] if started.args_start is not None else ""

    def _scan(self) -> None:
        if not self._started:  # where calls begin may yet move (llama3: a <|python_tag|> after JSON content)
            first = self.parser.stream_first(self.text, self.sent)
            if first != self._first:
                self._first, self._settled = first, 0
                self._scanner = CallScanner(first, self.parser.stream_gap) if first is not None else None
        if self._scanner is None:
            return
        try:
            scans = self._scanner.scan(self.text)
        except ValueError:  # not JSON after all: the finished reply decides (content, most likely)
            return
        for j in range(self._settled, len(scans)):
            if not self._stream_call(j, scans[j]):
                return
            if scans[j].end is not None and j == self._settled:  # all of it is out: its span will not grow
                self._settled += 1

    def _stream_call(self, j: int, scan) -> bool:
        """Start call j (its name out) and send its new arguments text; False: it cannot go out (yet), nor
        any after it."""
        name = self.parser.stream_name or scan.name
        if name is None or j > len(self._started) or self.parser.stream_needs_args and scan.args is None:
            return False
        if j == len(self._started):
            self._started.append(_Started(f"call_{uuid.uuid4().hex[:24]}", name))
            self._deltas.append({"index": j, "id": self._started[j].id, "type": "function",
                                 "function": {"name": name, "arguments": ""}})
        self._stream_args(j, self.parser.stream_args(self.text, self._first, scan))
        return True

    def _stream_args(self, j: int, span: tuple[int, int | None] | None) -> None:
        if span is None:
            return
        start, end = span[0], span[1] if span[1] is not None else len(self.text)
        started = self._started[j]
        if started.args_start is None:
            started.args_start = started.args_sent = start
        if start == started.args_start and end > started.args_sent:  # (a scan keeps the span it met first)
            self._deltas.append({"index": j, "function": {"arguments": self.text[started.args_sent:end]}})
            started.args_sent = end


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive pieces of one call as one entry (one `delta.tool_calls` item per call and chunk)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            fn = out[-1].setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + d.get("function", {}).get("arguments", "")
        else:
            out.append(copy.deepcopy(d))  # later pieces extend it
    return out
