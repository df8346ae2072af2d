"""The OpenAI generating routes: `POST /v1/chat/completions` and `POST /v1/completions`, streamed over SSE or
not. Each validates its request, `Served.start`s it (a failure up to the first output is an error response
even when streaming) and then either collects the whole reply or streams its pieces."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from lmjax.serve import responses as R
from lmjax.serve.errors import api_errors
from lmjax.serve.http_extras import client_request_id, json_body
from lmjax.serve.prompts import chat_echo, chat_prompt, chat_role, completion_prompts
from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmjax.serve.served import GONE, authorize, served
from lmjax.serve.stream_errors import chain as _chain, guarded as _guarded
from lmjax.serve.tool_stream import ToolStream

router = APIRouter(dependencies=[Depends(authorize), Depends(json_body)])


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request):
    s = served(raw)
    s.check_model(req.model)
    with api_errors():
        tools = req.tool_call_parser(s.tool_parser)
        if tools:  # call markers are special tokens in some vocabularies (InternLM2's): keep them, as vLLM
            req = req.model_copy(update={"skip_special_tokens": False})
        params = req.sampling_params(s.defaults(), s.limit)
        prompt = chat_prompt(s.engine, req)
    head = R.Head("chatcmpl", s.name, request_id=client_request_id(raw) or req.request_id)
    k, choices = req.top_logprobs or 0, R.Choices(req.n)
    decode, role, echo = s.named_by(req), chat_role(req), chat_echo(req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if (started := await s.start(raw, [prompt], params, requested)) is None:
        return Response(status_code=GONE)
    first, rest = started
    if not req.stream:
        if not await s.collect(raw, first, rest, choices):
            return Response(status_code=GONE)
        body = R.with_role_and_echo(R.chat_body(head, choices, k, decode, s.to_bytes, tools), role, echo)
        return {**body, "prompt_logprobs": R.prompt_logprobs(choices.outs[0], prompt[1], decode)}

    async def events():
        streams: dict[int, ToolStream] = {}  # choice index -> its held-back text, when parsing tool calls
        async for p, out in _chain(first, rest):
            new = choices.index(p, out) not in choices.outs
            i = choices.add(p, out)
            delta, finish = R.tool_delta(streams.setdefault(i, ToolStream(tools)), out) if tools \
                else ({"content": out.response}, out.finish_reason)
            logprobs = R.chat_logprobs(out, k, decode, s.to_bytes)
            if new and echo is not None:  # vLLM's: the echoed text is a chunk of its own, with the role
                yield R.sse(R.chat_chunk(head, i, {"role": role, "content": echo}))
            elif new:
                delta = {"role": role, "content": "", **delta}
            if delta or finish or logprobs:  # a piece held back whole (a call may be starting) sends nothing
                yield R.sse(R.running_usage(R.chat_chunk(head, i, delta, finish, logprobs, out.stop_reason),
                                            choices, req))
        if req.include_usage:
            yield R.sse(R.usage_chunk(head, "chat.completion.chunk", choices))
        yield R.sse("[DONE]")
    return StreamingResponse(_guarded(events()), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request):
    s = served(raw)
    s.check_model(req.model)
    with api_errors():
        params = req.sampling_params(s.defaults(), s.limit)
        prompts = completion_prompts(s.engine, req)
    echo = [R.Echo(t if t is not None else s.engine.tokenizer.decode(ids), ids) for t, ids in prompts] \
        if req.echo else None
    head = R.Head("cmpl", s.name, request_id=client_request_id(raw) or req.request_id)
    k, choices = req.logprobs or 0, R.Choices(req.n)
    decode = s.named_by(req)
    if (started := await s.start(raw, prompts, params, 1 if req.echo_only else req.max_tokens)) is None:
        return Response(status_code=GONE)
    first, rest = started
    if not req.stream:
        if not await s.collect(raw, first, rest, choices):
            return Response(status_code=GONE)
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
