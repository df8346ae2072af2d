"""What every route of the OpenAI-compatible server shares (lmjax.serve.openai_server builds one per app and
keeps it in `app.state.lmjax`): the engine, the names the model answers to, API keys, the tool-call parser,
the sampling defaults, and the two steps every generating route takes, `start` (validate, submit, await and
judge the first output) and `collect` (the rest of a non-streaming reply)."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from lmjax.api.async_engine import AsyncEngine
from lmjax.loader.tokenizer import token_bytes, token_text
from lmjax.serve import responses as R
from lmjax.serve.errors import APIError, api_errors
from lmjax.serve.prompts import fitted, no_room
from lmjax.serve.stream_errors import checked, consume
from lmjax.serve.streams import first_and_rest, merge, until_disconnect


GONE = 499  # the status of a response nobody reads: its client went away first


@dataclass
class Served:
    engine: AsyncEngine
    name: str  # the served model name
    names: set[str]  # every name a request's `model` may give (aliases, a Hugging Face id's short name)
    keys: set[str]  # API keys; empty: none needed
    tool_parser: object | None  # stateless: one for all requests
    sampling_defaults: dict | None  # None: the model's generation_config.json's (vLLM's --generation-config auto)
    max_tokens_overflow: str  # "error" (vLLM's 400) or "cut" (LMDeploy's)
    counter: itertools.count = field(default_factory=lambda: itertools.count(1 << 48))  # clear of interactive ids

    def defaults(self) -> dict:
        return self.engine.engine.sampling_defaults if self.sampling_defaults is None else self.sampling_defaults

    @property
    def limit(self) -> bool:  # vLLM: --generation-config DIR's max_new_tokens caps every request
        return self.sampling_defaults is not None

    def named_by(self, req) -> Callable[[int], str]:
        """How the request's logprobs name a token: its text, or vLLM's "token_id:{id}" when it asks so."""
        if req.return_tokens_as_token_ids:
            return lambda tid: f"token_id:{tid}"
        return lambda tid: token_text(self.engine.tokenizer, tid)

    def to_bytes(self, tid: int):
        return token_bytes(self.engine.tokenizer, tid)

    def new_session_id(self) -> int:
        """A session id no interactive session holds (a client may pick any id there)."""
        return next(sid for sid in self.counter if sid not in self.engine.id2step)

    def check_model(self, model: str | None) -> None:
        """A request's `model` must be a name of the served model (None: the routes where it is optional)."""
        if model is not None and model not in self.names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           "invalid_request_error", "model_not_found")

    async def start(self, raw: Request, prompts: list[tuple[str | None, list[int]]], params, requested: int | None):
        """Validate, submit every prompt and wait for the first output: (first, rest) of (prompt, GenOut)s,
        or None when the client went away first (a request still queued is aborted then, as vLLM's
        with_cancellation does, not when it would have produced its first token)."""
        engine = self.engine
        with api_errors():
            blocks = engine.engine.blocks.num_usable_blocks
            if len(prompts) * params.n > blocks:  # check_n's bound, for the request's sequences all together
                raise ValueError(f"{len(prompts)} prompts x n={params.n} is more sequences than the KV cache could "
                                 f"ever hold ({blocks} blocks, one at least each)")
            own = [fitted(engine.session_len, ids, params, requested, self.max_tokens_overflow) for _, ids in prompts]
            for (_, ids), p in zip(prompts, own):
                if p is None:  # no room at all (--max-tokens-overflow cut): LMDeploy's empty reply, no engine work
                    continue
                if p.guided_decoding is None:
                    engine.engine.validate_request(ids, p)
                else:  # it compiles the guide (up to ~0.3 s, then cached): off the event loop
                    await asyncio.to_thread(engine.engine.validate_request, ids, p)
            gens = [no_room(ids, params) if p is None else
                    engine.generate(None, self.new_session_id(), p, input_ids=ids, vllm_outputs=True)
                    for (_, ids), p in zip(prompts, own)]
            opening = asyncio.ensure_future(first_and_rest(merge(gens)))
            if not await until_disconnect(raw, opening):
                return None
            return await _judged(*opening.result())

    async def collect(self, raw: Request, first, rest, choices: R.Choices, openai: bool = True) -> bool:
        """A non-streaming response's outputs, all of them (False: the client went away first). An engine
        failure on the way is OpenAI's error body, as in `start`."""
        with api_errors(judging=False):
            return await until_disconnect(raw, consume(first, rest, choices, openai))


async def _judged(first, rest):
    """A request that fails on its first output is an error response, streamed or not (not a 200 whose
    stream holds only the error): the rest is closed (its engine requests aborted)."""
    try:
        return checked(first), rest
    except APIError:
        await rest.aclose()
        raise


def served(raw: Request) -> Served:
    return raw.app.state.lmjax


def authorize(raw: Request) -> None:
    """A route dependency: the request's bearer key, when the server has keys."""
    keys = served(raw).keys
    scheme, _, key = (raw.headers.get("authorization") or "").partition(" ")
    if keys and (scheme.lower() != "bearer" or key.strip() not in keys):  # (the scheme is case-free: RFC 7235)
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", "invalid_api_key")
