"""The one thread that owns an LLMEngine (which is synchronous and single-threaded) for `AsyncEngine`.

Other threads never call the engine: they put commands (plain callables) on a thread-safe queue. The
thread runs every pending command between two engine steps, steps the engine while it has unfinished
requests, and sleeps on the queue when it has none. After each step it pushes each changed request's
new output as `GenOut`s into that request's sink (a callable that must not block: it hands the item to
an asyncio loop or a plain queue); `None` marks the end, an exception a failure.

Session bookkeeping lives here too: which request is running for a session id (one at a time), and
`id2step` (the token count of each session's kept history, LMDeploy's name).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from lmjax.api.outputs import host_arrays
from lmjax.config import SamplingParams
from lmjax.engine.engine import LLMEngine
from lmjax.engine.request import ContextOverflowError, Request

logger = logging.getLogger("lmjax.engine")
_IDLE_POLL_S = 0.05  # how often an idle engine thread with idle work left looks for it (the worker's progress)
Sink = Callable[[object], None]


@dataclasses.dataclass
class GenOut:
    """One step's output of one completion (LMDeploy's GenOut, plus `index` and `cached_token_len`).

    `response` is the new text and `token_ids` the new tokens (the whole of them when not streaming);
    `input_token_len` counts this turn's prompt tokens, `history_token_len` the session's earlier tokens,
    `cached_token_len` the prompt tokens whose KV cache was reused instead of prefilled."""

    response: str
    history_token_len: int
    input_token_len: int
    generate_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    cached_token_len: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with SamplingParams.prompt_logprobs
    logits: Any = None  # output_logits' rows, on a completion's last output (lmjax.engine.host_outputs)
    last_hidden_state: Any = None
    error: str | None = None  # why, when finish_reason is "error" (lmjax's: LMDeploy's GenOut has no such field)
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it (None: EOS, length)
    stop_token_id: int | None = None  # the token that ended it (EOS or a stop id), on its last output
    prompt_ranks: list[int] | None = None  # with prompt_logprobs: each prompt token's rank in the vocabulary


@dataclasses.dataclass(eq=False)
class _Live:
    req: Request
    sink: Sink
    session_id: object
    history: int
    keep: bool
    done: set[int] = dataclasses.field(default_factory=set)


class EngineThread:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.id2step: dict = {}
        self.finished: collections.Counter = collections.Counter()  # finish reason -> completions
        self._running: dict = {}  # session id -> request id of its running turn
        self._live: dict[str, _Live] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # a command is queued before close's sentinel, or refused
        self._thread = threading.Thread(target=self._loop, name="lmjax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():  # nobody would read the command: fail, not hang
            raise RuntimeError("the engine is closed")

    def _put(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._check_open()
            self._commands.put(command)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread; its result or exception lands in the returned Future (a
        RuntimeError when the engine closed before the command's turn came)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command():
            try:
                self._check_open()
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001  (handed to the caller)
                future.set_exception(e)
        self._put(command)
        return future

    def call_stepping(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """`call` for a function that steps the engine itself (a synchronous batch run to its end): the
        requests of this thread's callers that it advanced, or finished, get their outputs afterwards."""
        def stepping():
            try:
                return fn()
            finally:
                for live in list(self._live.values()):
                    self._deliver(live)
        return self.call(stepping)

    def submit(self, session_id, ids: list[int], params: SamplingParams, text: str | None, sequence_start: bool,
               sequence_end: bool, sink: Sink, step: int = 0) -> str:
        """Queue one request; errors (a prompt over session_len, a busy session, the engine closed before the
        request's turn came) arrive in the sink."""
        request_id = f"{session_id}-{next(_ids)}"

        def command():
            try:
                self._check_open()
                self._add(request_id, session_id, ids, params, text, sequence_start, sequence_end, sink, step)
            except ContextOverflowError as e:  # LMDeploy's "run out of tokens": an empty "length" output
                self._overflowed(session_id, ids, params, e, sink, sequence_start, sequence_end)
            except Exception as e:  # noqa: BLE001  (ValueError for a bad prompt; the caller raises it)
                _quietly(sink, e) and _quietly(sink, None)
        self._put(command)
        return request_id

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Queue an abort; the Future is done once the engine thread has done it (at once when the engine is
        closed: closing aborted every request)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command():
            try:
                self._abort(request_id)
            finally:
                if done.set_running_or_notify_cancel():  # (False: a waiter cancelled it; the abort is done anyway)
                    done.set_result(None)
        try:
            self._put(command)
        except RuntimeError:
            done.set_result(None)
        return done

    def close(self) -> None:
        """Stop the engine thread: every live request ends with "abort" (delivered), every command queued
        before is refused ("the engine is closed"); a second close does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread only
    def add_many(self, batch: list[tuple]) -> list[str]:
        """(session id, ids, params, text, sink) each: every request validated before any is queued.
        Returns their request ids."""
        overflowed = self.engine.validate_batch([(ids, params) for _, ids, params, _, _ in batch])
        rids = [f"{session_id}-{next(_ids)}" for session_id, *_ in batch]
        added = []
        try:
            for i, (rid, (session_id, ids, params, text, sink)) in enumerate(zip(rids, batch)):
                if i in overflowed:
                    self._overflowed(session_id, ids, params, overflowed[i], sink, True, True)
                else:
                    self._add(rid, session_id, ids, params, text, True, True, sink)
                    added.append(rid)
        except BaseException:  # one failing past validation: the caller gets the error, nothing keeps running
            for rid in added:
                self._abort(rid)
            raise
        return rids

    def _overflowed(self, session_id, ids, params, error: ContextOverflowError, sink: Sink, sequence_start: bool,
                    sequence_end: bool) -> None:
        """LMDeploy's answer to a turn that leaves no room in session_len: each completion an empty output
        with finish reason "length" (the error logged); a session's last turn (`sequence_end`) ends it."""
        kept = None if sequence_start else self.engine.sessions.get(session_id)
        history = len(kept.token_ids) if kept is not None else 0
        req = self.engine.overflowed_request(ids, params, error)
        for c in req.completions:
            _quietly(sink, GenOut("", history, len(ids), 0, "length", [], c.logprobs, c.index))
            self.finished["length"] += 1
        if sequence_end and not sequence_start:
            self.end_session(session_id)
        _quietly(sink, None)

    def stop_session(self, session_id) -> None:
        request_id = self._running.get(session_id)
        if request_id is not None:
            self._abort(request_id)

    def end_session(self, session_id) -> None:
        self.stop_session(session_id)
        self.engine.end_session(session_id)
        self.id2step.pop(session_id, None)

    def _add(self, request_id, session_id, ids, params, text, sequence_start, sequence_end, sink, step=0) -> None:
        if session_id in self._running:
            raise ValueError(f"session {session_id} is busy with another request")
        history = 0 if sequence_start else len(self.engine.sessions[session_id].token_ids) \
            if session_id in self.engine.sessions else 0
        if step and not sequence_start:
            history = min(history, step)  # (add_session_request checks it)
        elif step:
            raise ValueError(f"step={step!r} needs a session to continue (sequence_start=False)")
        if sequence_start and sequence_end:
            req = self.engine.add_request(ids, params, text, request_id)
            self.end_session(session_id)
        else:
            req = self.engine.add_session_request(session_id, ids, params, sequence_start, sequence_end, text,
                                                  request_id, step)
        self.id2step.pop(session_id, None)
        self._running[session_id] = request_id
        self._live[request_id] = _Live(req, sink, session_id, history, not sequence_end)

    def _abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            self.engine.abort(request_id)
            self._deliver(live)

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            # idle: the engine's idle work (traces, prefetched compilations); while some remains, poll for commands
            timeout = _IDLE_POLL_S if block and self.engine.idle_work() else None
            while True:
                try:
                    command = self._commands.get(block=block, timeout=timeout if block else None)
                except queue.Empty:
                    break
                if command is None:
                    for request_id in list(self._live):
                        self._abort(request_id)
                    return
                try:
                    command()
                except Exception:  # noqa: BLE001  (a command's own failure must not stop the engine thread)
                    logger.exception("engine command failed")
                block = False
            if self.engine.has_unfinished():
                try:
                    self._step()
                except Exception:  # noqa: BLE001  (a delivery bug must not stop the engine thread either)
                    logger.exception("engine step delivery failed")

    def _step(self) -> None:
        try:
            changed = self.engine.step()
        except Exception as e:  # noqa: BLE001  (a device failure: fail every request, keep serving)
            logger.exception("engine step failed")
            for live in list(self._live.values()):
                if self._emit(live, RuntimeError(f"engine step failed: {e}")):
                    self._abort(live.req.request_id)
            return
        for req in changed:
            live = self._live.get(req.request_id)
            if live is not None:
                self._deliver(live)

    def _deliver(self, live: _Live) -> None:
        req = live.req
        for c in req.completions:
            if c.index in live.done:
                continue
            text, ids = c.take_delta()
            if not (text or ids or c.finished):
                continue
            end = len(c.token_ids)
            logprobs = None if c.logprobs is None else c.logprobs[end - len(ids):end]
            if not self._emit(live, GenOut(text, live.history, len(req.prompt_token_ids) - live.history, end,
                                           c.finish_reason, ids, logprobs, c.index, req.num_cached_tokens,
                                           req.prompt_logprobs, **host_arrays(c),
                                           error=req.error if c.finish_reason == "error" else None,
                                           stop_reason=c.stop_reason if c.finished else None,
                                           stop_token_id=c.stop_token_id if c.finished else None,
                                           prompt_ranks=req.prompt_ranks)):
                return
            if c.finished:
                live.done.add(c.index)
                self.finished[c.finish_reason] += 1
        if req.finished:
            self._retire(live)
            self._emit(live, None)

    def _retire(self, live: _Live) -> None:
        """A finished request's bookkeeping: its completions' finish reasons counted, it leaves _live and
        _running, a kept session's length recorded (LMDeploy's id2step)."""
        for c in live.req.completions:
            if c.finished and c.index not in live.done:
                live.done.add(c.index)
                self.finished[c.finish_reason] += 1
        self._live.pop(live.req.request_id, None)
        if self._running.get(live.session_id) == live.req.request_id:
            del self._running[live.session_id]
        kept = self.engine.sessions.get(live.session_id) if live.keep else None
        if kept is not None:
            self.id2step[live.session_id] = kept.num_tokens

    def _emit(self, live: _Live, item) -> bool:
        """Hand `item` to the request's consumer; False when it is gone (an asyncio loop closed under an
        abandoned generator, say): then the request is dropped, its blocks freed, and the engine thread
        goes on serving the others."""
        if _quietly(live.sink, item):
            return True
        logger.info("request %s: its consumer is gone; aborting it", live.req.request_id)
        self.engine.abort(live.req.request_id)
        self._retire(live)
        return False


def _quietly(sink: Sink, item) -> bool:
    """sink(item); False (logged at debug level) if it raised."""
    try:
        sink(item)
        return True
    except Exception as e:  # noqa: BLE001  (a consumer's failure is its own; the engine thread goes on)
        logger.debug("sink failed: %r", e)
        return False


_ids = iter(range(1, 1 << 62))


def merge_outputs(acc: GenOut | None, item: GenOut) -> GenOut:
    """Fold a streamed piece into the accumulated output of its completion (a copy on first use)."""
    if acc is None:
        return dataclasses.replace(item, token_ids=list(item.token_ids),
                                   logprobs=None if item.logprobs is None else list(item.logprobs))
    response, acc.response = acc.response, ""  # one reference: grown in place, not copied every piece
    response += item.response
    acc.response = response
    acc.token_ids += item.token_ids
    if acc.logprobs is not None and item.logprobs:
        acc.logprobs += item.logprobs
    acc.generate_token_len, acc.finish_reason = item.generate_token_len, item.finish_reason
    acc.logits, acc.last_hidden_state, acc.error = item.logits, item.last_hidden_state, item.error
    acc.stop_reason, acc.stop_token_id = item.stop_reason, item.stop_token_id
    return acc
