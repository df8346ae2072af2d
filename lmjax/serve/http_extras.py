"""What the OpenAI server adds around its routes, as vLLM's and LMDeploy's servers do: CORS, vLLM's
`GET /version`, and vLLM's client-chosen request ids.

CORS (settings: lmjax.serve.cors): LMDeploy and vLLM both install Starlette's CORSMiddleware allowing every
origin, method and header, without credentials, unless told otherwise; lmjax keeps those defaults so a browser
front end (a chat UI served from another port) can call the server. The server binds 127.0.0.1 unless asked (the
CLI's default), and a server with API keys still wants its key from a browser's request as from any other.

Request ids: a request's `X-Request-Id` header becomes its response id (`cmpl-<id>`, `chatcmpl-<id>`, as
vLLM's `_base_request_id`), and the header is sent back on the response, so a proxy can match its logs with
the server's. Without the header the id is random.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from lmjax.serve.cors import CorsConfig
from lmjax.version import __version__

REQUEST_ID_HEADER = "X-Request-Id"


def install(app: FastAPI, cors: CorsConfig | None = CorsConfig()) -> None:
    """Add CORS (None: none), the request-id echo and GET /version to `app`."""
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allow_origins),
                           allow_credentials=cors.allow_credentials, allow_methods=list(cors.allow_methods),
                           allow_headers=list(cors.allow_headers), expose_headers=[REQUEST_ID_HEADER])

    app.add_middleware(_EchoRequestId)

    @app.get("/version")
    async def version():
        return {"version": __version__}


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
