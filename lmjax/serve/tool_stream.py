"""Streaming a reply that a tool-call parser reads (lmjax.serve.tool_parsers): content as it comes, and each
call as OpenAI streams it: a first `delta.tool_calls` entry with the call's index, id, type and name once the
name is complete, then pieces of its `arguments` as the model writes them (vLLM streams them so too).

The arguments streamed are the JSON text the model wrote for them (an object or array value), which is
also what the finished reply's `arguments` holds (`call_from_json(raw=...)`), so the pieces add up to it.
Arguments written as a JSON string, and calls whose name or arguments a scan cannot place, go out whole
when the reply is complete. A call whose name went out and which then turns out malformed stays in the
stream (the finished reply's text is content then, as in a non-streaming reply); vLLM does the same.

The scan (lmjax.serve.json_scan) walks the text so far: it needs no complete JSON, only the top-level
"name" string and where the "arguments" / "parameters" value starts and, once complete, ends.
"""
from __future__ import annotations

import copy
import dataclasses
import uuid

from lmjax.serve.json_scan import scan_calls
from lmjax.serve.tool_parsers import ToolCall, ToolParser

@dataclasses.dataclass
class _Started:
    id: str
    name: str
    sent_args: str = ""  # the arguments text streamed so far


class ToolStream:
    """One streamed choice: `feed(delta)` -> content that can go out now (`take_call_deltas()` then the
    calls' pieces); `finish()` -> (the rest of the content, calls) once the reply is complete, and
    `final_call_deltas(calls)` what the stream still owes of each call."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.sent = parser, "", 0
        self.max_calls = getattr(parser, "max_calls", None)  # (parallel_tool_calls=false: 1)
        self._started: list[_Started] = []
        self._deltas: list[dict] = []

    def feed(self, delta: str) -> str:
        self.text += delta
        self._scan()
        end = self.parser.content_end(self.text)
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
            elif call.arguments.startswith(self._started[j].sent_args):
                rest = call.arguments[len(self._started[j].sent_args):]
                if rest:
                    deltas.append({"index": j, "function": {"arguments": rest}})
        self._deltas = []
        return self._allowed(_merged(deltas))

    def _allowed(self, deltas: list[dict]) -> list[dict]:
        return deltas if self.max_calls is None else [d for d in deltas if d["index"] < self.max_calls]

    def _scan(self) -> None:
        first = self.parser.stream_first(self.text)
        if first is None:
            return
        try:
            scans = scan_calls(self.text, first, self.parser.stream_gap)
        except ValueError:  # not JSON after all: the finished reply decides (content, most likely)
            return
        for j, scan in enumerate(scans):
            name = self.parser.stream_name or scan.name
            if name is None or j > len(self._started) or self.parser.stream_needs_args and scan.args is None:
                return
            if j == len(self._started):
                self._started.append(_Started(f"call_{uuid.uuid4().hex[:24]}", name))
                self._deltas.append({"index": j, "id": self._started[j].id, "type": "function",
                                     "function": {"name": name, "arguments": ""}})
            self._stream_args(j, self.parser.stream_args(self.text, first, scan))

    def _stream_args(self, j: int, span: tuple[int, int | None] | None) -> None:
        if span is None:
            return
        start, end = span
        written = self.text[start:end if end is not None else len(self.text)]
        started = self._started[j]
        if len(written) > len(started.sent_args) and written.startswith(started.sent_args):
            self._deltas.append({"index": j, "function": {"arguments": written[len(started.sent_args):]}})
            started.sent_args = written


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
