"""`lmjax chat`: a streaming multi-turn chat in the terminal over one AsyncEngine session.

A message is the lines typed up to an empty one (LMDeploy's "double enter to end input"), so it can span
lines. Each turn is `generate(..., sequence_start=<first turn>, sequence_end=False)`: the session keeps its
KV cache, so a turn prefills only its own message. 'end' starts a new session, 'exit' (or EOF) quits.
A turn that would overflow session_len ends the session with a notice and is sent again in a new one (the
history is reset); one that does not fit even a new session is said not to be sent.
"""
from __future__ import annotations

import asyncio
import sys

from lmjax.api.async_engine import AsyncEngine


class _NoRoom(ValueError):
    """The session has no room left for the message: nothing of it was answered, so it can be sent again."""


async def _turn(engine: AsyncEngine, text: str, session_id: int, first: bool, gen_config, out) -> None:
    """Stream one reply; _NoRoom when the session has no room left for it (LMDeploy's engine answers that
    with an empty "length" output)."""
    async for piece in engine.generate(text, session_id, gen_config, sequence_start=first, sequence_end=False):
        if piece.finish_reason == "length" and piece.generate_token_len == 0:
            raise _NoRoom(f"the session's {piece.history_token_len} tokens and this message's "
                             f"{piece.input_token_len} leave no room in session_len={engine.session_len}")
        out.write(piece.response)
        out.flush()
    out.write("\n")


def _valid_utf8(text: str) -> str:
    """Bytes that are not UTF-8 (read from stdin as lone surrogates) become U+FFFD, as a lenient decoder
    would: the tokenizer takes only valid text."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate outside the escape range
        return text.encode("utf-8", "replace").decode("utf-8")


def _read_message(stdin) -> str | None:
    """The lines up to an empty one (blank lines before the first are skipped), joined; None at EOF with
    nothing read."""
    lines = []
    while line := stdin.readline():
        line = line.rstrip("\n")
        if line.strip():
            lines.append(line)
        elif lines:
            break
    return "\n".join(lines) if lines else None


def run_chat(engine: AsyncEngine, gen_config, stdin=None, out=None) -> None:
    """Read turns from `stdin` until 'exit' or EOF, streaming each reply to `out`."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    session_id, first = 1, True
    out.write(f"lmjax chat: {engine.model_name} (session_len={engine.session_len}). End a message with an "
              "empty line (double enter); 'end' starts a new session, 'exit' quits.\n")
    try:
        while True:
            out.write("\ndouble enter to end input >>> ")
            out.flush()
            text = _read_message(stdin)
            if text is None or text.strip() == "exit":
                break
            text = _valid_utf8(text)
            if text.strip() == "end":
                engine.end_session(session_id).result()
                session_id, first = session_id + 1, True
                out.write("(new session)\n")
                continue
            session_id, first = _send(engine, text, session_id, first, gen_config, out)
    except KeyboardInterrupt:
        out.write("\n")


def _send(engine: AsyncEngine, text: str, session_id: int, first: bool, gen_config, out) -> tuple[int, bool]:
    """One turn; the (session_id, first) the next one takes. A failed turn ends the session. One the session
    had no room for is sent again in a new session, saying the history is reset, rather than dropped with
    only the engine's log line (on stderr) to tell; unless the session was new already (it would not fit
    again): then the chat says it was not sent."""
    try:
        asyncio.run(_turn(engine, text, session_id, first, gen_config, out))
        return session_id, False
    except ValueError as e:  # e.g. the session no longer fits session_len
        engine.end_session(session_id).result()
        if not isinstance(e, _NoRoom) or first:
            unsent = ": the message was not sent" if isinstance(e, _NoRoom) else ""
            out.write(f"\n({e}{unsent}; starting a new session)\n")
            return session_id + 1, True
        out.write(f"\n({e}; starting a new session: the history is reset and the message sent again)\n")
    return _send(engine, text, session_id + 1, True, gen_config, out)
