"""What the OpenAI server adds around its routes, as vLLM's and LMDeploy's servers do: CORS, vLLM's
`GET /version`, and vLLM's client-chosen request ids.

CORS (settings: lmjax.serve.cors): LMDeploy and vLLM both install Starlette's CORSMiddleware allowing every
origin, method and header, without credentials, unless told otherwise; lmjax keeps those defaults so a browser
front end (a chat UI served from another port) can call the server. The server binds 127.0.0.1 unless asked (the
CLI's default), and a server with API keys still wants its key from a browser's request as from any other.

Request ids: a request's `X-Request-Id` header becomes its response id (`cmpl-<id>`, `chatcmpl-<id>`, as
vLLM's `_base_request_id`), and the header is sent back on the response, so a proxy can match its logs with
the server's. Without the header the id is random.

Load: vLLM's `GET /load` answers {"server_load": N}, the generation requests in flight (a streamed one until
its stream ends); vLLM counts only with --enable-server-load-tracking (else 0), lmjax always.

Content type: vLLM's routes taking a JSON body refuse another media type with "Unsupported Media Type: Only
'application/json' is allowed" (a 400 in vLLM's current server, a 415 in older ones); a request with no
Content-Type at all is still read as JSON here (scripts built on raw sockets send none), where vLLM
refuses it too.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from lmjax.serve.cors import CorsConfig
from lmjax.serve.errors import APIError
from lmjax.version import __version__

REQUEST_ID_HEADER = "X-Request-Id"
LOADED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/chat/interactive")


def install(app: FastAPI, cors: CorsConfig | None = CorsConfig()) -> None:
    """Add CORS (None: none), the request-id echo and GET /version to `app`."""
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allow_origins),
                           allow_credentials=cors.allow_credentials, allow_methods=list(cors.allow_methods),
                           allow_headers=list(cors.allow_headers), expose_headers=[REQUEST_ID_HEADER])

    app.add_middleware(_EchoRequestId)
    app.state.server_load = 0
    app.add_middleware(_CountLoad, state=app.state)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():
        return {"server_load": app.state.server_load}


class _CountLoad:
    """Counts the generation requests in flight on `state.server_load` (plain ASGI: the app's call returns
    when a streamed body has ended, or the client left)."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in LOADED_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


async def json_body(request: Request) -> None:
    """vLLM's validate_json_request, as a route dependency (see the module's docstring)."""
    media_type = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json":
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")


class _EchoRequestId:
    """Sends a request's X-Request-Id back on its response (plain ASGI: no buffering of streamed bodies, and
    disconnects reach the routes as they are)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        rid = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None) \
            if scope["type"] == "http" else None
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


def client_request_id(request: Request) -> str | None:
    """The id the client chose for its request (vLLM's X-Request-Id), if any."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    return rid if rid else None
