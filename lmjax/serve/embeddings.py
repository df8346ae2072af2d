"""OpenAI's `POST /v1/embeddings` (vLLM's embeddings endpoint): the request body, its run on the AsyncEngine,
and the response body.

Data flow: `EmbeddingRequest` -> `prompt_ids`: token ids per input (a string tokenized, with the tokenizer's
special tokens unless add_special_tokens=false; token ids taken as they are; vLLM's chat form renders
`messages` through the server's chat template), each cut to its last `truncate_prompt_tokens` tokens, then
checked (empty, ids outside the vocabulary, longer than the context), so a bad input is a 400 naming it
before any work -> `embed`: every input submitted to the engine thread in ONE command, so the scheduler
takes them as one batch, each a request for one greedy token with output_last_hidden_state="generation"
(lmjax.config.PoolingSampling) -> the final GenOut of each carries the final-norm hidden state of its
last prompt token -> lmjax.api.embed.pool (L2-normalized unless normalize=false: exactly `LLM.embed`) ->
`embedding_body`: floats, or base64 of little-endian float32 bytes (OpenAI's and vLLM's encoding).

Differences from vLLM: the engine samples one token after the prompt, so the longest input is
max_model_len - 1 tokens (vLLM embeds max_model_len) and truncate_prompt_tokens=-1 keeps that many;
`dimensions` (Matryoshka truncation) is a 400 for any value, as vLLM answers for models not trained for it.
"""
from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any, Literal

import numpy as np
from pydantic import Field

from lmjax.api.embed import pool
from lmjax.api.engine_thread import GenOut, merge_outputs
from lmjax.config import PoolingSampling, SamplingParams
from lmjax.validation import check_token_ids
from lmjax.serve.protocol import chat_request
from lmjax.serve.protocol_base import ChatMessage, _Nullable
from lmjax.serve.responses import Head
from lmjax.serve.streams import drain


class EmbeddingRequest(_Nullable):
    """OpenAI's fields, vLLM's extras, and vLLM's chat form: exactly one of `input` and `messages`.
    add_special_tokens None is vLLM's default: true for `input`, false for `messages` (their template
    writes its own). add_generation_prompt defaults to false here, as in vLLM's chat embeddings."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's, as /v1/chat/completions takes them
    chat_template_kwargs: dict[str, Any] | None = None

    def _single(self) -> bool:
        return isinstance(self.input, str) or bool(self.input) and isinstance(self.input[0], int)

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a string or a list of token ids."""
        if self._single():
            return [self.input]
        if not self.input:
            raise ValueError("input=[] is empty: give a string, a list of strings, a list of token ids or a "
                             "list of token-id lists")
        return list(self.input)

    def names(self) -> list[str]:
        """How errors name each input: `input`, `input[i]` or `messages`."""
        if self.messages is not None:
            return ["messages"]
        return ["input"] if self._single() else [f"input[{i}]" for i in range(len(self.inputs()))]

    def token_ids(self, tokenizer, render_chat) -> list[list[int]]:
        """Each input's ids before truncation. render_chat(ChatCompletionRequest) -> (text, ids): the
        server's own chat rendering (/v1/chat/completions')."""
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input and messages")
        if self.messages is not None:
            return [render_chat(chat_request(self))[1]]
        add = self.add_special_tokens is not False
        out = []
        for name, x in zip(self.names(), self.inputs()):
            if x == "":  # OpenAI refuses it too; a tokenizer with BOS would embed BOS alone
                raise ValueError(f"{name} is an empty string: give some text")
            out.append(tokenizer(x, add_special_tokens=add)["input_ids"] if isinstance(x, str) else list(x))
        return out

    def keep_last(self, session_len: int) -> int | None:
        """truncate_prompt_tokens as a count (-1: the longest input the context takes), checked."""
        k, longest = self.truncate_prompt_tokens, session_len - 1
        if k is None:
            return None
        if k == -1:
            return longest
        if not 1 <= k <= longest:
            raise ValueError(f"truncate_prompt_tokens={k} must be -1 or in [1, {longest}]: this model's maximum "
                             f"context length is {session_len} tokens, less the one token the engine samples after "
                             "an embedding's prompt")
        return k


def prompt_ids(req: EmbeddingRequest, tokenizer, render_chat, vocab: int, session_len: int,
               hidden: int) -> list[list[int]]:
    """The ids each input embeds, every input checked (a ValueError naming the bad one) before any runs."""
    if req.dimensions is not None:
        raise ValueError(f"dimensions={req.dimensions} is not supported: this model has no Matryoshka "
                         f"representation (its embeddings have {hidden} dimensions); leave dimensions out")
    k = req.keep_last(session_len)
    prompts = [ids[-k:] if k else ids for ids in req.token_ids(tokenizer, render_chat)]
    for name, ids in zip(req.names(), prompts):
        if not ids:
            raise ValueError(f"{name} has no tokens: give at least one")
        check_token_ids(f"{name} token ids", ids, vocab)
        if len(ids) >= session_len:
            raise ValueError(f"{name} has {len(ids)} tokens, but this model's maximum context length is "
                             f"{session_len} tokens and an embedding's prompt may take at most {session_len - 1} "
                             "(the engine samples one token after it); shorten it or set truncate_prompt_tokens")
    return prompts


async def embed(engine, prompts: list[list[int]], normalize: bool | None) -> list[list[float]]:
    """The embedding of each prompt (ids already checked). Cancelling the caller (a client gone) aborts
    the requests; an engine failure raises its RuntimeError."""
    loop, items = asyncio.get_running_loop(), asyncio.Queue()
    sinks = [functools.partial(_hand_over, loop, items, p) for p in range(len(prompts))]
    rids = await _submit(engine, prompts, PoolingSampling.embedding(), sinks)
    finals: dict[int, GenOut] = {}
    done = False
    try:
        async for p, item in drain(items, len(prompts)):  # each request's sink ends with None
            finals[p] = merge_outputs(finals.get(p), item)
        done = True
    finally:
        if not done:
            _abort(engine, rids)
    return [pool(_hidden_row(finals.get(p), p), normalize) for p in range(len(prompts))]


def _hand_over(loop, items: asyncio.Queue, position: int, item) -> None:
    """A request's sink, called on the engine thread: hand (position, item) to the request's event loop."""
    loop.call_soon_threadsafe(items.put_nowait, (position, item))


async def _submit(engine, prompts: list[list[int]], params: SamplingParams, sinks) -> list[str]:
    """Queue the batch (request ids back). A caller cancelled meanwhile still gets its requests aborted
    once queued: the submission itself is shielded."""
    task = asyncio.ensure_future(asyncio.to_thread(engine.submit_batch, [(None, ids) for ids in prompts],
                                                   [params] * len(prompts), sinks))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.exception() is None and _abort(engine, t.result()))
        raise


def _abort(engine, rids: list[str]) -> None:
    engine.abort(rids)  # a finished request's abort is a no-op on the engine thread


def _hidden_row(out: GenOut | None, position: int):
    """The final hidden state [D] of a finished embedding request."""
    if out is None or out.last_hidden_state is None:
        reason = None if out is None else out.finish_reason
        raise RuntimeError(f"embedding input {position} ended without a hidden state (finish reason {reason!r})")
    return out.last_hidden_state[0]


def embedding_body(head: Head, vectors: list[list[float]], encoding_format: str, prompt_tokens: int) -> dict:
    """OpenAI's response: `data` in input order, usage counting the prompt tokens embedded (after truncation)."""
    data = [{"object": "embedding", "embedding": _encoded(v, encoding_format), "index": i}
            for i, v in enumerate(vectors)]
    return {**head.fields("list"), "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what openai-python decodes with np.frombuffer(..., "float32")
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector
