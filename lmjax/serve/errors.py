"""The OpenAI server's error mapping: what a route's work raises, as OpenAI's error body and status."""
from __future__ import annotations

import contextlib

from fastapi.exceptions import RequestValidationError


class APIError(Exception):
    """An error response: its HTTP status and OpenAI's body fields. `code` is OpenAI's own where it has one
    ("invalid_api_key", "model_not_found"), else the status, as vLLM's and LMDeploy's error bodies carry it:
    a client reading an error inside a streamed 200 learns the status the request would have had unstreamed."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, status if code is None else code


@contextlib.contextmanager
def api_errors(judging: bool = True):
    """The one mapping of what a route's work raises to OpenAI's error body: the request's fault (a value or
    type the checks refuse, a feature lmjax lacks) is a 400; the engine failing or being closed is a 500
    "server_error", not a bare 500. Routes wrap only the work that judges the request, so a bug in building
    the response still surfaces as a 500 of its own; `judging=False` (collecting outputs, the request already
    accepted) maps the engine's failures only."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError) as e:
        if judging and isinstance(e, (ValueError, TypeError, NotImplementedError)):  # (a RuntimeError too)
            raise APIError(400, str(e)) from None
        if isinstance(e, RuntimeError):
            raise APIError(500, str(e), "server_error") from None
        raise


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message naming every bad field, the first bad field for the error's `param`)."""
    parts, fields = [], []
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # its loc holds a character offset, not a field
            parts.append(f"the request body is not valid JSON: {e.get('msg')} (at character {e['loc'][-1]})")
            fields.append(None)
            continue
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        fields.append(where)
    return "; ".join(parts) or "invalid request", next((f for f in fields if f), None)
