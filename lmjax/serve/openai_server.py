"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncEngine.

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (streaming over SSE or not),
`POST /v1/embeddings` (OpenAI's and vLLM's: lmjax.serve.embeddings),
`POST /v1/chat/interactive` (LMDeploy's session endpoint: newline-delimited JSON when streaming),
`POST /v1/encode` (LMDeploy's tokenizer endpoint), `POST /tokenize` and `POST /detokenize` (vLLM's),
`GET /health` (and vLLM's `/ping`), `GET /metrics` (Prometheus text), `GET /version`, `GET /load`; CORS,
X-Request-Id and the JSON Content-Type check: lmjax.serve.http_extras.
`/v1/*`, `/tokenize` and `/detokenize` need
`Authorization: Bearer KEY` when the server has API keys (vLLM leaves its tokenizer routes open; they read
nothing private, but cost work). Errors are OpenAI-style bodies `{"error": {"message", "type", "param",
"code"}}`: 400 for a malformed or out-of-range request (FastAPI's 422 becomes 400), 401 for a bad key, 404
for an unknown model. The model answers to its served name and to the aliases it is given, a Hugging Face
id among them also by its short name (`HuggingFaceTB/SmolLM2-135M-Instruct` and `SmolLM2-135M-Instruct`).
With `tool_call_parser` (a name in lmjax.serve.tool_parsers) a chat request's `tools` are rendered by the
template and its reply parsed for calls; without one, `tools` with tool_choice "auto" are a 400 (vLLM's rule).

A request is validated and its first output awaited (and judged: an "error" finish is an error
response) before the response starts, so a prompt over session_len, or a request whose first token fails, is
a 400 even when streaming; later failures end the stream (lmjax.serve.stream_errors). A client that disconnects cancels its generator, which aborts
the engine request and frees its KV blocks (a request waiting for its first output, or a non-streaming one,
polls for a disconnect).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmjax.api.async_engine import AsyncEngine
from lmjax.serve import responses as R
from lmjax.serve import routes_generate, routes_info, routes_interactive
from lmjax.serve.cors import CorsConfig
from lmjax.serve.errors import APIError, validation_message
from lmjax.serve.http_extras import install
from lmjax.serve.prompts import OVERFLOW_CHOICES, accepted_names, chat_prompt  # noqa: F401 (the server's names)
from lmjax.serve.served import Served
from lmjax.serve.tool_parsers import get_tool_parser

logger = logging.getLogger("lmjax.serve")


def create_app(engine: AsyncEngine, api_keys: list[str] | None = None, model_name: str | None = None,
               model_aliases: tuple[str, ...] = (), tool_call_parser: str | None = None,
               sampling_defaults: dict | None = None, cors: CorsConfig | None = CorsConfig(),
               docs: bool = True, max_tokens_overflow: str = "error") -> FastAPI:
    """sampling_defaults: the values of sampling fields a request leaves out (None: the model's
    generation_config.json's, vLLM's `--generation-config auto`). cors: the CORS answers (None: no CORS
    headers; lmjax.serve.http_extras), which also adds GET /version and X-Request-Id ids. docs: the Swagger
    page at /docs, as vLLM's (LMDeploy's --disable-fastapi-docs turns it off). max_tokens_overflow: "error" (a
    max_tokens the context cannot hold is a 400, vLLM's) or "cut" (LMDeploy's: cut to the room left)."""
    if max_tokens_overflow not in OVERFLOW_CHOICES:
        raise ValueError(f"max_tokens_overflow must be one of {OVERFLOW_CHOICES}, got {max_tokens_overflow!r}")
    app = FastAPI(title="lmjax", docs_url="/docs" if docs else None, redoc_url=None)
    install(app, cors)
    name = model_name or engine.model_name
    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    app.state.lmjax = Served(engine, name, accepted_names(name, model_aliases), set(api_keys or ()), tool_parser,
                             sampling_defaults, max_tokens_overflow)
    _install_error_handlers(app)
    for routes in (routes_info, routes_generate, routes_interactive):
        app.include_router(routes.router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI's body; FastAPI's 422 for a malformed request is a 400."""
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(R.error_body(exc.message, exc.type, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(R.error_body(message, code=400, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return JSONResponse(R.error_body(str(exc.detail), "invalid_request_error", exc.status_code),
                            status_code=exc.status_code)
