"""Response bodies of the HTTP API as plain dicts (OpenAI's JSON shapes), built from AsyncEngine GenOuts.

`Choices` accumulates the outputs of one HTTP request (several prompts x n completions each) into
choices and usage; the `*_chunk` functions build the streaming (SSE) pieces.
"""
from __future__ import annotations

import json
import time
import uuid

from lmjax.api.engine_thread import GenOut, merge_outputs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str = "invalid_request_error", code: str | int | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(out: GenOut, k: int, decode) -> dict | None:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    if out.logprobs is None:
        return None
    content = []
    for tid, entry in zip(out.token_ids, out.logprobs):
        tok = decode(tid)
        content.append({"token": tok, "logprob": entry[tid], "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": decode(t), "logprob": lp, "bytes": list(decode(t).encode())}
                                         for t, lp in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(out: GenOut, k: int, decode, offset: int = 0) -> dict | None:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    if out.logprobs is None:
        return None
    tokens = [decode(t) for t in out.token_ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(out.token_ids, out.logprobs)],
            "top_logprobs": [{decode(t): lp for t, lp in _top(e, k)} for e in out.logprobs], "text_offset": offsets}


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


def chat_body(request_id: str, model: str, choices: Choices, k: int, decode) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": o.response},
                         "logprobs": chat_logprobs(o, k, decode), "finish_reason": o.finish_reason}
                        for i, o in sorted(choices.outs.items())],
            "usage": choices.usage()}


def completion_body(request_id: str, model: str, choices: Choices, k: int, decode, echo: list[str] | None) -> dict:
    items = []
    for i, o in sorted(choices.outs.items()):
        prefix = echo[i // choices.n] if echo else ""
        items.append({"index": i, "text": prefix + o.response, "finish_reason": o.finish_reason,
                      "logprobs": completion_logprobs(o, k, decode, len(prefix))})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": items, "usage": choices.usage()}


def chat_chunk(request_id: str, model: str, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def completion_chunk(request_id: str, model: str, index: int, text: str, finish_reason=None, logprobs=None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, obj: str, choices: Choices) -> dict:
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": choices.usage()}
