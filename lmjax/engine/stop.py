"""Stop strings on streamed text (host side).

The detokenizer hands over text a few characters at a time, and a stop string can straddle
several tokens ("<|end" + "|>"). `StopStringMatcher.feed(new_text)` appends the new text, looks
for a stop string ending in it (the first listed that is found, as vLLM), and returns what may be shown now:
- a stop string found: the text before it (through it with include_stop_str_in_output), and
  stopped=True; the engine then finishes the request with finish_reason "stop";
- otherwise: everything except a held-back tail that is a prefix of some stop string, so a stop
  word split across tokens never leaks. `flush()` releases that tail when generation ends for
  another reason (EOS, length).

The search only looks at the not-yet-emitted text plus the longest stop string's length, so
each step costs O(new text + held tail), not O(output).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    text: str                  # text to emit now
    stopped: bool
    stop_str: str | None = None


def find_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop) of the first listed stop found ending at or after `start`, where new text begins (each
    stop searched from start - len(stop) + 1): vLLM checks stop strings in their order as text streams in,
    so stop=["39", "t3"] on " t39" stops at "39"."""
    return next(((i, stop) for stop in stops if (i := text.find(stop, max(0, start - len(stop) + 1))) >= 0), None)


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string. Only the prefixes
    ending in text's last character are tried (found with rfind, in C): a request's thousand long stop strings
    cost microseconds a token, not the engine thread's time (one tail check per prefix length was quadratic)."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        n = min(len(stop) - 1, len(text))
        while n > longest:
            n = stop.rfind(last, 0, n) + 1  # the longest prefix stop[:n] <= n ending with `last`
            if n <= longest:
                break
            if text.endswith(stop[:n]):
                longest = n
                break
            n -= 1
    return longest


class StopStringMatcher:
    """Per-request stop-string state; `text` is the output text (truncated at the stop)."""

    def __init__(self, stops: Sequence[str] | None, include_stop_str_in_output: bool = False):
        self.stops = [s for s in (stops or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""       # all text fed so far (cut at the stop once stopped)
        self.emitted = 0     # len(text) already returned to the caller
        self.stopped = False
        self.stop_str: str | None = None

    def feed(self, new_text: str, armed: bool = True) -> StopResult:
        """armed=False (output tokens not past min_tokens, as vLLM V1 counts them): the text is not
        searched. A stop is looked for where it could end in the new text, so one that begins in earlier
        text counts (before min_tokens too: vLLM's look-back). A tail that could begin a stop is held back
        either way (already emitted text could not be cut)."""
        if self.stopped:
            return StopResult("", True, self.stop_str)
        start = len(self.text)
        self.text += new_text
        hit = find_stop(self.text, start, self.stops) if armed else None
        if hit is not None:
            return self._stop(*hit)
        # With the stop string included in the output, nothing needs holding back.
        hold = 0 if self.include_stop_str_in_output else partial_stop_len(self.text, self.stops)
        return StopResult(self._release(len(self.text) - hold), False)

    def flush(self) -> str:
        """Generation ended without a stop string: release the held-back tail."""
        return "" if self.stopped else self._release(len(self.text))

    def _stop(self, index: int, stop: str) -> StopResult:
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.stopped, self.stop_str = True, stop
        piece = self._release(end)
        self.text = self.text[:end]
        return StopResult(piece, True, stop)

    def _release(self, end: int) -> str:
        piece, self.emitted = self.text[self.emitted:end], max(end, self.emitted)
        return piece
