"""A request as the engine tracks it: one prompt, n sampled completions, each completion a Sequence in
the scheduler plus its host-side text state (detokenizer, stop strings, logprobs).

The facades read these objects: `Completion.text` / `token_ids` / `finish_reason`, and for streaming
`Completion.take_delta()` hands out what arrived since the last call.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Container
from typing import Any

from lmjax.config import SamplingParams
from lmjax.engine.detokenizer import IncrementalDetokenizer
from lmjax.engine.sequence import Sequence
from lmjax.engine.stop import StopStringMatcher
from lmjax.validation import check_token_ids

_request_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Completion:
    """One of a request's n outputs."""

    index: int
    seq: Sequence
    seed: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled id included
    ranks: list[int] = dataclasses.field(default_factory=list)  # per token with logprobs: the sampled id's rank
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    stop_token_id: int | None = None  # the token (EOS or a stop id) that ended it, whatever stop_reason says
    _emitted_text: int = 0
    _emitted_tokens: int = 0
    _text: str = ""
    _lag: int = 0  # newest output tokens not detokenized yet (see `text`)
    hidden_tail: int = 0  # 1 when the last token stopped the request and its text is left out (vLLM)
    guide: Any = None  # its lmjax.engine.guided.GuideState, for a guided request
    host_rows: Any = None  # lmjax.engine.host_outputs.HostRows, with output_logits / output_last_hidden_state

    @property
    def token_ids(self) -> list[int]:
        return self.seq.output_token_ids

    @property
    def text(self) -> str:
        """The output text. Without stop strings nothing on the engine's path needs it, so the engine
        only counts new tokens (`defer_text`) and they are detokenized here, when someone reads the text
        (a stream every step, `generate` once at the end): the host's per-token work, which the device
        waits on between decode calls, shrinks to bookkeeping."""
        self.catch_up_text()
        return self._text

    def catch_up_text(self) -> None:
        """Detokenize the deferred tokens (before a flush, or when the text is read)."""
        if self._lag:
            end = len(self.token_ids) - self.hidden_tail
            ids, self._lag = self.token_ids[end - self._lag:end], 0
            self._text += self.stops.feed(self.detokenizer.step(ids)).text

    def add_text(self, piece: str) -> None:
        self._text = self.text + piece

    def defer_text(self) -> None:
        """One more output token whose text is decoded on the next read of `text` (never, with
        SamplingParams.detokenize False: the text stays "")."""
        if self.seq.params is None or self.seq.params.detokenize:
            self._lag += 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_delta(self) -> tuple[str, list[int]]:
        """Text and token ids produced since the previous call (for streaming)."""
        text, ids = self.text[self._emitted_text:], self.token_ids[self._emitted_tokens:]
        self._emitted_text, self._emitted_tokens = len(self.text), len(self.token_ids)
        return text, ids


@dataclasses.dataclass
class RequestMetrics:
    """vLLM's (V0) RequestMetrics, wall-clock seconds (time.time()): when the request arrived, first had a step
    (time_in_queue = the wait), got its first and latest tokens (as the host read them: a multi-step call's
    tokens all at once) and finished."""
    arrival_time: float = dataclasses.field(default_factory=time.time)
    last_token_time: float | None = None  # None: arrival_time, until a token comes (vLLM's)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None

    def __post_init__(self):
        self.last_token_time = self.arrival_time if self.last_token_time is None else self.last_token_time

    def scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time, self.time_in_queue = now, now - self.arrival_time

    def token(self, now: float) -> None:
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # max_tokens after capping at session_len - prompt length
    completions: list[Completion] = dataclasses.field(default_factory=list)
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int] | None = None  # each prompt token's rank under the logits before it
    num_cached_tokens: int = 0
    error: str | None = None
    allowed_W: Any = None  # allowed_token_ids as a packed mask (lmjax.engine.guided), fixed for its life
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


def new_request_id(taken: Container[str] = ()) -> str:
    """A fresh id, none of `taken` (the unfinished requests' ids: a caller may have chosen "7" itself)."""
    while (request_id := str(next(_request_ids))) in taken:
        pass
    return request_id


class ContextOverflowError(ValueError):
    """A prompt (a session's history included) that leaves no room to generate within session_len. vLLM's
    LLM and the OpenAI routes raise it; LMDeploy's facades answer it with an empty output whose finish
    reason is "length" (LMDeploy's "run out of tokens")."""


def check_prompt(prompt_token_ids: list[int], vocab: int, session_len: int) -> None:
    """A ValueError naming what is wrong with a prompt: empty, no room to generate (ContextOverflowError),
    ids outside the vocab."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    if n >= session_len:
        raise ContextOverflowError(f"prompt of {n} tokens does not fit the context of {session_len} tokens (session_len, "
                         "vLLM's max_model_len; at least one token must be generated)")
    check_token_ids("prompt token ids", prompt_token_ids, vocab)


def check_sampling_ids(params: SamplingParams, vocab: int) -> None:
    """check_token_ids for every id field of `params`: each reaches the sampler (an int32 column on the
    device), where an id past int32 would fail the whole step and one outside the vocabulary do nothing."""
    for name in ("stop_token_ids", "bad_token_ids", "allowed_token_ids"):
        check_token_ids(name, getattr(params, name) or (), vocab)
    check_token_ids("logit_bias token ids", params.logit_bias or (), vocab)


def check_n(params: SamplingParams, num_blocks: int) -> None:
    """A ValueError for an n the cache could never run: more sequences than KV blocks (each needs one of its
    own). Checked before any work: a request of n=10**9 would otherwise build 10**9 completions on the engine
    thread, stalling every other request. Below that, n > max_batch_size runs in waves, as in vLLM."""
    if params.n > num_blocks:
        raise ValueError(f"n={params.n} is more sequences than the KV cache could ever hold ({num_blocks} blocks, "
                         "one at least each)")


def in_vocab_terms(params: SamplingParams, vocab: int) -> SamplingParams:
    """`params` with the vocabulary's size put for what stands for it: a top_k of the whole vocabulary or more
    made 0 (off; the same tokens stay in play, as vLLM clamps top_k >= vocab_size, and the value, up to 2**63
    over HTTP, never reaches the sampler's int32 column); logprobs / prompt_logprobs -1 (vLLM's "the whole
    vocabulary") made `vocab`. Other params come back as they are."""
    changes = {"top_k": 0} if params.top_k >= vocab else {}
    changes.update({name: vocab for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1})
    return dataclasses.replace(params, **changes) if changes else params


def check_logprobs(params: SamplingParams, vocab: int, max_logprobs: int) -> None:
    """A ValueError for `logprobs` / `prompt_logprobs` above max_logprobs (-1: the vocabulary), which
    would otherwise fail inside the jitted step for the whole batch."""
    cap = vocab if max_logprobs == -1 else min(max_logprobs, vocab)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        k = vocab if k == -1 else k
        if k is not None and k > cap:
            raise ValueError(f"{name}={k} is more than max_logprobs={cap} (EngineConfig(max_logprobs=...), "
                             f"LLM(max_logprobs=...); -1 allows up to the vocabulary, {vocab})")


def truncated_prompt(prompt_token_ids: list[int], params: SamplingParams, session_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation), else all of them. -1 (vLLM's
    "as many as the model takes"): session_len - 1, the longest prompt that leaves room for a token."""
    k = params.truncate_prompt_tokens
    k = session_len - 1 if k == -1 else k
    return list(prompt_token_ids)[-k:] if k and len(prompt_token_ids) > k else prompt_token_ids
