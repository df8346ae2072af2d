"""Response bodies of the HTTP API as plain dicts (OpenAI's JSON shapes), built from AsyncEngine GenOuts.

`Choices` accumulates the outputs of one HTTP request (several prompts x n completions each) into
choices and usage; the `*_chunk` functions build the streaming (SSE) pieces. With a tool-call parser
(lmjax.serve.tool_parsers) a chat reply's calls become `message.tool_calls` / `delta.tool_calls`.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from lmjax.api.engine_thread import GenOut, merge_outputs
from lmjax.api.outputs import logprob_dicts
from lmjax.serve.tool_parsers import ToolParser
from lmjax.serve.tool_stream import ToolStream


@dataclasses.dataclass(frozen=True)
class Head:
    """What every body and chunk of one response repeats: its id, model and creation time (one
    `created` for the whole stream, as OpenAI and vLLM send it)."""
    prefix: dataclasses.InitVar[str]
    model: str
    id: str = ""
    created: int = 0
    request_id: dataclasses.InitVar[str | None] = None  # the client's X-Request-Id (vLLM's id: prefix-<it>)

    def __post_init__(self, prefix: str, request_id: str | None):
        object.__setattr__(self, "id", f"{prefix}-{request_id or uuid.uuid4().hex[:24]}")
        object.__setattr__(self, "created", int(time.time()))

    def fields(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclasses.dataclass(frozen=True)
class Echo:
    """A completions prompt sent back with `echo`: its text and token ids."""
    text: str
    ids: list[int]


def error_body(message: str, type_: str = "invalid_request_error", code: str | int | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_permission() -> dict:
    """vLLM's ModelPermission of a /v1/models card (what OpenAI's old API listed): everything a server allows."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


LOGPROB_FLOOR = -9999.0  # vLLM's: a masked token's -inf in the top logprobs (a guided row's) is not JSON


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return [(t, max(lp, LOGPROB_FLOOR)) for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:k]]


def chat_logprobs(out: GenOut, k: int, decode, to_bytes=None) -> dict | None:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}. `to_bytes(id)`: a
    token's own bytes (lmjax.loader.tokenizer.token_bytes), which rejoin a character split over tokens."""
    if out.logprobs is None:
        return None
    to_bytes = to_bytes or (lambda tid: decode(tid).encode())
    content = []
    for tid, entry in zip(out.token_ids, out.logprobs):
        content.append({"token": decode(tid), "logprob": entry[tid], "bytes": list(to_bytes(tid)),
                        "top_logprobs": [{"token": decode(t), "logprob": lp, "bytes": list(to_bytes(t))}
                                         for t, lp in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(out: GenOut, k: int, decode, offset: int = 0, echo: Echo | None = None) -> dict | None:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset. With `echo` the
    prompt's tokens come first (from the request's prompt logprobs; the first token has none: null), their
    offsets from 0 in the echoed text, as OpenAI's legacy completions and vLLM give them."""
    if out.logprobs is None:
        return None
    ids, entries = list(out.token_ids), list(out.logprobs)
    prompt = echo is not None and out.prompt_logprobs is not None
    if prompt:
        ids, entries = echo.ids + ids, list(out.prompt_logprobs) + entries
    tokens = [decode(t) for t in ids]
    offsets, pos = [], 0 if prompt else offset
    for i, tok in enumerate(tokens):
        pos = offset if prompt and i == len(echo.ids) else pos  # the echoed text may decode apart
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[t] for t, e in zip(ids, entries)],
            "top_logprobs": [None if e is None else _top_with_chosen(e, k, t, decode) for t, e in zip(ids, entries)],
            "text_offset": offsets}


def _top_with_chosen(entry: dict[int, float], k: int, chosen: int, decode) -> dict[str, float]:
    """Legacy completions' top_logprobs: the k likeliest tokens and always the chosen one (OpenAI: "up to
    logprobs + 1 elements"; vLLM alike), so logprobs=0 still names the token."""
    return {decode(t): lp for t, lp in _top(entry, k) + [(chosen, entry[chosen])]}


class Choices:
    """The choices of one HTTP request: prompt `p`'s completion `i` is choice `p * n + i`."""

    def __init__(self, n: int):
        self.n = n
        self.outs: dict[int, GenOut] = {}
        self.prompt_tokens: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, cached)

    def index(self, prompt_index: int, out: GenOut) -> int:
        return prompt_index * self.n + out.index

    def add(self, prompt_index: int, out: GenOut) -> int:
        """Record a (delta) output; returns its choice index."""
        i = self.index(prompt_index, out)
        self.prompt_tokens[prompt_index] = (out.history_token_len + out.input_token_len, out.cached_token_len)
        self.outs[i] = merge_outputs(self.outs.get(i), out)
        return i

    def usage(self) -> dict:
        prompt = sum(p for p, _ in self.prompt_tokens.values())
        completion = sum(o.generate_token_len for o in self.outs.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c for _, c in self.prompt_tokens.values())}}


def chat_message(text: str, finish_reason: str | None, tools: ToolParser | None = None) -> tuple[dict, str | None]:
    """The assistant message of a finished reply and its finish_reason. With a tool-call parser, calls found
    in the text become `tool_calls`, the text before them the content (or null), and the finish_reason
    the parser's ("tool_calls" for tool_choice "auto", as vLLM) when the model ended the reply itself (cut by
    max_tokens it stays "length": a call may be missing); a reply without calls, or with malformed ones, is
    plain content."""
    if tools is not None:
        content, calls = tools.parse(text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_dict() for c in calls]}
            return message, _calls_finish(tools, finish_reason)
    return {"role": "assistant", "content": text}, finish_reason


def prompt_logprobs(out: GenOut, prompt_ids: list[int], decode) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` of a response: per prompt token None (the first: nothing before it) or
    {"id": {"logprob", "rank", "decoded_token"}} for the token and the top ones; None when not asked for."""
    if out.prompt_logprobs is None:
        return None
    dicts = logprob_dicts(out.prompt_logprobs, None, prompt_ids, out.prompt_ranks)
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode(t)}
                                    for t, lp in d.items()} for d in dicts]


def chat_body(head: Head, choices: Choices, k: int, decode, to_bytes=None, tools: ToolParser | None = None) -> dict:
    items = []
    for i, o in sorted(choices.outs.items()):
        message, finish_reason = chat_message(o.response, o.finish_reason, tools)
        items.append({"index": i, "message": message, "logprobs": chat_logprobs(o, k, decode, to_bytes),
                      "finish_reason": finish_reason, "stop_reason": o.stop_reason})
    return {**head.fields("chat.completion"), "choices": items, "usage": choices.usage()}


def with_role_and_echo(body: dict, role: str, echo: str | None) -> dict:
    """A chat body whose replies have this role and start with the echoed text (vLLM's chat echo; None:
    nothing echoed)."""
    for choice in body["choices"]:
        choice["message"]["role"] = role
        if echo is not None:
            choice["message"]["content"] = echo + (choice["message"]["content"] or "")
    return body


def tool_delta(stream: ToolStream, out: GenOut) -> tuple[dict, str | None]:
    """(delta, finish_reason) of one streamed piece when the reply is parsed for tool calls: the content that
    is surely not a call and the calls' new pieces (lmjax.serve.tool_stream); at the end the rest of both."""
    content = stream.feed(out.response)
    if out.finish_reason is None:
        return _with_calls({"content": content} if content else {}, stream.take_call_deltas()), None
    rest, calls = stream.finish()
    delta = {"content": content + rest} if content + rest else {}
    if not calls:  # (pieces of a call that turned out malformed went out already)
        return _with_calls(delta, stream.take_call_deltas()), out.finish_reason
    return _with_calls(delta, stream.final_call_deltas(calls)), _calls_finish(stream.parser, out.finish_reason)


def _calls_finish(tools: ToolParser, finish_reason: str | None) -> str | None:
    """A reply with calls: the parser's finish_reason if the model stopped by itself, else the engine's (vLLM)."""
    return tools.calls_finish_reason if finish_reason == "stop" else finish_reason


def _with_calls(delta: dict, calls: list[dict]) -> dict:
    return {**delta, "tool_calls": calls} if calls else delta


def prompt_only(out: GenOut) -> GenOut:
    """A completion's output without what it generated (echo with max_tokens 0): the prompt's part stays."""
    return dataclasses.replace(out, response="", token_ids=[], generate_token_len=0, stop_reason=None,
                               stop_token_id=None, finish_reason=out.finish_reason and "length",
                               logprobs=None if out.logprobs is None else [])


def completion_body(head: Head, choices: Choices, k: int, decode, echo: list[Echo] | None,
                    prompt_ids: list[list[int]]) -> dict:
    items = []
    for i, o in sorted(choices.outs.items()):
        e = echo[i // choices.n] if echo else None
        prefix = e.text if e else ""
        items.append({"index": i, "text": prefix + o.response, "finish_reason": o.finish_reason,
                      "stop_reason": o.stop_reason, "logprobs": completion_logprobs(o, k, decode, len(prefix), e),
                      "prompt_logprobs": prompt_logprobs(o, prompt_ids[i // choices.n], decode)})
    return {**head.fields("text_completion"), "choices": items, "usage": choices.usage()}


def chat_chunk(head: Head, index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
    return {**head.fields("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def completion_chunk(head: Head, index: int, out: GenOut, k: int, decode, echo: Echo | None, offset: int) -> dict:
    """One streamed piece of choice `index`; `echo` (the first piece only) puts the prompt before it."""
    text = (echo.text if echo else "") + out.response
    return {**head.fields("text_completion"),
            "choices": [{"index": index, "text": text, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason,
                         "logprobs": completion_logprobs(out, k, decode, offset, echo)}]}


def usage_chunk(head: Head, obj: str, choices: Choices) -> dict:
    return {**head.fields(obj), "choices": [], "usage": choices.usage()}


def running_usage(chunk: dict, choices: Choices, req) -> dict:
    """`chunk` with the usage so far when the request asks for it in every chunk (vLLM's continuous_usage_stats,
    which takes include_usage too)."""
    options = req.stream_options
    if req.include_usage and options.continuous_usage_stats:
        chunk["usage"] = choices.usage()
    return chunk
