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

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmjax.api.async_engine import AsyncEngine
from lmjax.validation import check_token_ids
from lmjax.loader.tokenizer import token_bytes, token_text
from lmjax.serve import responses as R
from lmjax.serve.errors import APIError, api_errors, validation_message
from lmjax.serve.cors import CorsConfig
from lmjax.serve.http_extras import client_request_id, install, json_body
from lmjax.serve.embeddings import EmbeddingRequest, embed, embedding_body, prompt_ids
from lmjax.serve.metrics import render_metrics
from lmjax.serve.lmdeploy_protocol import EncodeRequest, InteractiveRequest
from lmjax.serve.prompts import OVERFLOW_CHOICES, accepted_names, chat_echo, chat_prompt, completion_prompts, fitted
from lmjax.serve.prompts import no_room
from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmjax.serve.stream_errors import chain as _chain, checked as _checked, consume as _consume
from lmjax.serve.stream_errors import guarded as _guarded, json_line as _json_line
from lmjax.serve.streams import first_and_rest, merge, until_disconnect
from lmjax.serve.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from lmjax.serve.tool_parsers import get_tool_parser
from lmjax.serve.tool_stream import ToolStream

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

    def defaults() -> dict:
        return engine.engine.sampling_defaults if sampling_defaults is None else sampling_defaults
    limit = sampling_defaults is not None  # vLLM: --generation-config DIR's max_new_tokens caps every request

    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None  # stateless: one for all
    name = model_name or engine.model_name
    names = accepted_names(name, model_aliases)
    keys = set(api_keys or ())
    counter = itertools.count(1 << 48)  # ids of OpenAI requests, clear of /v1/chat/interactive's
    def named_by(req) -> Callable[[int], str]:
        """How the request's logprobs name a token: its text, or vLLM's "token_id:{id}" when it asks so."""
        if req.return_tokens_as_token_ids:
            return lambda tid: f"token_id:{tid}"
        return lambda tid: token_text(engine.tokenizer, tid)
    to_bytes = lambda tid: token_bytes(engine.tokenizer, tid)  # noqa: E731

    def new_session_id() -> int:
        """A session id no interactive session holds (a client may pick any id there)."""
        return next(sid for sid in counter if sid not in engine.id2step)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(R.error_body(exc.message, exc.type, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(R.error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return JSONResponse(R.error_body(str(exc.detail), "invalid_request_error", exc.status_code),
                            status_code=exc.status_code)

    def authorize(request: Request) -> None:
        scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        if keys and (scheme.lower() != "bearer" or key.strip() not in keys):  # (the scheme is case-free: RFC 7235)
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")

    def check_model(model: str) -> None:
        if model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                           "invalid_request_error", "model_not_found")

    async def start(raw: Request, prompts: list[tuple[str | None, list[int]]], params, requested: int | None):
        """Validate, submit every prompt and wait for the first output: (first, rest) of (prompt, GenOut)s,
        or None when the client went away first (a request still queued is aborted then, as vLLM's
        with_cancellation does, not when it would have produced its first token)."""
        with api_errors():
            blocks = engine.engine.blocks.num_usable_blocks
            if len(prompts) * params.n > blocks:  # check_n's bound, for the request's sequences all together
                raise ValueError(f"{len(prompts)} prompts x n={params.n} is more sequences than the KV cache could "
                                 f"ever hold ({blocks} blocks, one at least each)")
            own = [fitted(engine.session_len, ids, params, requested, max_tokens_overflow) for _, ids in prompts]
            for (_, ids), p in zip(prompts, own):
                if p is None:  # no room at all (--max-tokens-overflow cut): LMDeploy's empty reply, no engine work
                    continue
                if p.guided_decoding is None:
                    engine.engine.validate_request(ids, p)
                else:  # it compiles the guide (up to ~0.3 s, then cached): off the event loop
                    await asyncio.to_thread(engine.engine.validate_request, ids, p)
            gens = [no_room(ids, params) if p is None else
                    engine.generate(None, new_session_id(), p, input_ids=ids, vllm_outputs=True)
                    for (_, ids), p in zip(prompts, own)]
            opening = asyncio.ensure_future(first_and_rest(merge(gens)))
            if not await until_disconnect(raw, opening):
                return None
            return await _judged(*opening.result())

    async def _judged(first, rest):
        """A request that fails on its first output is an error response, streamed or not (not a 200 whose
        stream holds only the error): the rest is closed (its engine requests aborted)."""
        try:
            return _checked(first), rest
        except APIError:
            await rest.aclose()
            raise

    async def collect(raw: Request, first, rest, choices: R.Choices, openai: bool = True) -> bool:
        """A non-streaming response's outputs, all of them (False: the client went away first). An engine
        failure on the way is OpenAI's error body, as in `start`."""
        with api_errors(judging=False):
            return await until_disconnect(raw, _consume(first, rest, choices, openai))

    @app.get("/health")
    async def health():
        return {"status": "ok"}
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for /health

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine, name), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lmjax", "root": name,
                "parent": None, "max_model_len": engine.session_len, "permission": [R.model_permission()]}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorize)])
    async def model(model: str):  # openai-python's client.models.retrieve
        check_model(model)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize), Depends(json_body)])
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        with api_errors():
            tools = req.tool_call_parser(tool_parser)
            if tools:  # call markers are special tokens in some vocabularies (InternLM2's): keep them, as vLLM
                req = req.model_copy(update={"skip_special_tokens": False})
            params = req.sampling_params(defaults(), limit)
            prompt = chat_prompt(engine, req)
        head = R.Head("chatcmpl", name, request_id=client_request_id(raw) or req.request_id)
        k, choices = req.top_logprobs or 0, R.Choices(req.n)
        decode, echo = named_by(req), chat_echo(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if (started := await start(raw, [prompt], params, requested)) is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        first, rest = started
        if not req.stream:
            if not await collect(raw, first, rest, choices):
                return Response(status_code=499)  # the client is gone: nobody reads this
            body = R.with_echo(R.chat_body(head, choices, k, decode, to_bytes, tools), echo)
            return {**body, "prompt_logprobs": R.prompt_logprobs(choices.outs[0], prompt[1], decode)}

        async def events():
            streams: dict[int, ToolStream] = {}  # choice index -> its held-back text, when parsing tool calls
            async for p, out in _chain(first, rest):
                new = choices.index(p, out) not in choices.outs
                i = choices.add(p, out)
                delta, finish = R.tool_delta(streams.setdefault(i, ToolStream(tools)), out) if tools \
                    else ({"content": out.response}, out.finish_reason)
                logprobs = R.chat_logprobs(out, k, decode, to_bytes)
                if new and echo is not None:  # vLLM's: the echoed text is a chunk of its own, with the role
                    yield R.sse(R.chat_chunk(head, i, {"role": "assistant", "content": echo}))
                elif new:
                    delta = {"role": "assistant", "content": "", **delta}
                if delta or finish or logprobs:  # a piece held back whole (a call may be starting) sends nothing
                    yield R.sse(R.running_usage(R.chat_chunk(head, i, delta, finish, logprobs, out.stop_reason),
                                                choices, req))
            if req.include_usage:
                yield R.sse(R.usage_chunk(head, "chat.completion.chunk", choices))
            yield R.sse("[DONE]")
        return StreamingResponse(_guarded(events()), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=[Depends(authorize), Depends(json_body)])
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        with api_errors():
            params = req.sampling_params(defaults(), limit)
            prompts = completion_prompts(engine, req)
        echo = [R.Echo(t if t is not None else engine.tokenizer.decode(ids), ids) for t, ids in prompts] \
            if req.echo else None
        head = R.Head("cmpl", name, request_id=client_request_id(raw) or req.request_id)
        k, choices = req.logprobs or 0, R.Choices(req.n)
        decode = named_by(req)
        if (started := await start(raw, prompts, params, 1 if req.echo_only else req.max_tokens)) is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        first, rest = started
        if not req.stream:
            if not await collect(raw, first, rest, choices):
                return Response(status_code=499)  # the client is gone: nobody reads this
            if req.echo_only:
                choices.outs = {i: R.prompt_only(o) for i, o in choices.outs.items()}
            return R.completion_body(head, choices, k, decode, echo, [ids for _, ids in prompts])

        async def events():
            async for p, out in _chain(first, rest):
                out = R.prompt_only(out) if req.echo_only else out
                before = choices.outs.get(choices.index(p, out))
                echoed = echo[p] if echo and before is None else None  # the prompt goes out with the first piece
                offset = (len(echo[p].text) if echo else 0) + (len(before.response) if before else 0)
                i = choices.add(p, out)  # (folds `out` into `before` in place)
                yield R.sse(R.running_usage(R.completion_chunk(head, i, out, k, decode, echoed, offset), choices, req))
            if req.include_usage:
                yield R.sse(R.usage_chunk(head, "text_completion", choices))
            yield R.sse("[DONE]")
        return StreamingResponse(_guarded(events()), media_type="text/event-stream")

    # ---- /v1/embeddings (lmjax.serve.embeddings) ----
    @app.post("/v1/embeddings", dependencies=[Depends(authorize), Depends(json_body)])
    async def embeddings(req: EmbeddingRequest, raw: Request):
        """All inputs of a request run as one batch; a bad input is a 400 naming it before any work."""
        if req.model is not None:
            check_model(req.model)
        config = engine.engine.model_config
        with api_errors():  # the engine's own checks too (KV cache size: NotImplementedError)
            prompts = prompt_ids(req, engine.tokenizer, lambda chat: chat_prompt(engine, chat), config.vocab_size,
                                 engine.session_len, config.hidden_size)
            work = asyncio.ensure_future(embed(engine, prompts, req.normalize))
            if not await until_disconnect(raw, work):
                return Response(status_code=499)  # the client is gone: nobody reads this
            vectors = work.result()
        head = R.Head("embd", name, request_id=client_request_id(raw))
        return embedding_body(head, vectors, req.encoding_format, sum(map(len, prompts)))
    # ---- end /v1/embeddings ----

    @app.post("/v1/encode", dependencies=[Depends(authorize)])
    async def encode(req: EncodeRequest):
        """LMDeploy's: token ids and their count, a list of each for a list input."""
        with api_errors():  # add_bos=False: a later turn (no BOS, and the template's text that follows a reply)
            ids = [engine.encode(text, sequence_start=req.add_bos, do_preprocess=req.do_preprocess)[1]
                   for text in req.inputs()]
        if isinstance(req.input, str):
            return {"input_ids": ids[0], "length": len(ids[0])}
        return {"input_ids": ids, "length": [len(i) for i in ids]}

    @app.post("/tokenize", dependencies=[Depends(authorize), Depends(json_body)])
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the ids of a prompt or of chat messages as /v1/chat/completions would render them."""
        if req.model is not None:
            check_model(req.model)
        with api_errors():
            ids = req.token_ids(engine.tokenizer, lambda chat: chat_prompt(engine, chat))
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.session_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(authorize), Depends(json_body)])
    async def detokenize(req: DetokenizeRequest):
        """vLLM's: the text of token ids (special tokens kept, as vLLM)."""
        if req.model is not None:
            check_model(req.model)
        with api_errors():
            check_token_ids("tokens", req.tokens, engine.engine.model_config.vocab_size)
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/interactive", dependencies=[Depends(authorize)])
    async def chat_interactive(req: InteractiveRequest, raw: Request):
        if req.cancel and req.session_id == -1:  # as LMDeploy: a fresh id has nothing to cancel
            raise APIError(400, "please set a session_id to cancel a request")
        sid = req.session_id if req.session_id != -1 else new_session_id()
        # A turn the client left (a closed stream) is aborted by the engine thread: wait for that before reading
        # the history it keeps, or the next turn sent at once would start the session over.
        await engine.settle(sid)
        history = engine.id2step.get(sid, 0)
        # LMDeploy's APIClient.end_session sends request_output_len=0: an end even of a session with no
        # history yet (its first turn may still be running)
        ends = not req.interactive_mode and req.prompt == "" and (history or req.request_output_len == 0)
        if req.cancel or ends:
            await (engine.stop_session(sid) if req.cancel else engine.end_session(sid))
            # LMDeploy answers a cancel with these same fields: finish_reason "stop", history_tokens 0
            return {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0 if req.cancel else history,
                    "finish_reason": "stop", "session_id": sid}
        with api_errors():
            gen = engine.generate(req.prompt, sid, req.gen_config(), sequence_start=history == 0,
                                  sequence_end=not req.interactive_mode)
            first, rest = await first_and_rest(merge([gen]))
        choices = R.Choices(1)

        def line(out, text) -> dict:
            return {"text": text, "tokens": out.generate_token_len, "input_tokens": out.input_token_len,
                    "history_tokens": out.history_token_len, "finish_reason": out.finish_reason, "session_id": sid}
        if not req.stream:
            if not await collect(raw, first, rest, choices, openai=False):
                return Response(status_code=499)  # the client is gone: nobody reads this
            return line(choices.outs[0], choices.outs[0].response)

        async def lines():
            async for _, out in _chain(first, rest, openai=False):
                yield _json_line(line(out, out.response))
        return StreamingResponse(_guarded(lines(), frame=_json_line), media_type="application/x-ndjson")

    return app
