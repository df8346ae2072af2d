"""How the server's routes meet a failure in a request's outputs: the "error" finish reason as an error
response (`chain`, `checked`), and a failure after a streamed response started as the stream's last items
(`guarded`). Split from openai_server.py."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

from lmjax.api.engine_thread import GenOut
from lmjax.serve import responses as R
from lmjax.serve.errors import APIError

logger = logging.getLogger("lmjax.serve")


async def chain(first, rest, openai: bool = True):
    """The (prompt, GenOut)s of a response. On the OpenAI routes a completion that ended with "error" (nothing
    left to sample, a step input the request broke) fails the whole response with its reason, as vLLM answers
    its "error" finish reason with an error response instead of a choice; a 400, since what fails one request
    and no other is that request's doing (a 5xx would also make openai-python retry it twice). LMDeploy's
    /v1/chat/interactive (`openai=False`) answers it as LMDeploy does, a line whose finish_reason is "error"."""
    yield checked(first) if openai else first
    async for item in rest:
        yield checked(item) if openai else item


def checked(item: tuple[int, GenOut]) -> tuple[int, GenOut]:
    out = item[1]
    if out.finish_reason == "error":
        raise APIError(400, f"the request failed: {out.error or 'no reason given'}")
    return item


async def consume(first, rest, choices: R.Choices, openai: bool = True) -> None:
    async for p, out in chain(first, rest, openai):
        choices.add(p, out)


def json_line(body: dict) -> str:
    """One line of /v1/chat/interactive's application/x-ndjson stream (LMDeploy's framing: no SSE `data:`)."""
    return json.dumps(body, ensure_ascii=False) + "\n"


async def guarded(events, frame: Callable[[dict], str] = R.sse):
    """A failure after the response started can only be reported in the stream itself, framed as the
    stream's other items are (`frame`: SSE on the OpenAI routes, a JSON line on the interactive one, where
    an SSE-framed error was a line its clients could not parse). The error body is the one a response not
    yet started would have had; an SSE stream then still ends with `data: [DONE]`, as vLLM's always do
    (clients wait for it)."""
    try:
        async for e in events:
            yield e
        return
    except APIError as e:
        body = R.error_body(e.message, e.type, e.code)
    except (ValueError, RuntimeError) as e:
        body = R.error_body(str(e), "server_error", 500)
    logger.warning("stream failed: %s", body["error"]["message"])
    yield frame(body)
    if frame is R.sse:
        yield R.sse("[DONE]")
