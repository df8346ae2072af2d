"""LMDeploy's `AsyncEngine`: many asyncio tasks (and threads) share one synchronous LLMEngine.

Data flow: a caller encodes its prompt and sends an *add* command, with a sink for its outputs, over a
thread-safe queue to ONE engine thread (`_EngineLoop`), the only thread that ever touches the LLMEngine.
That thread runs pending commands (add, abort, end session) between steps, steps the engine while it has
work, and after each step pushes every changed request's new text and tokens (`Completion.take_delta()`)
as `GenOut`s into the request's sink: an asyncio queue fed through `loop.call_soon_threadsafe` for
`generate`, a plain queue for the synchronous `batch_infer`. A `None` in the sink ends the request.
A generator that is cancelled or abandoned (a client that disconnects) sends an abort, which frees the
request's KV blocks.

Sessions (`session_id`, `sequence_start`, `sequence_end`) map onto `LLMEngine.add_session_request`: a turn
with `sequence_end=False` keeps its KV cache, and the next turn with `sequence_start=False` prefills only
its new tokens. `step` (LMDeploy's KV offset): 0 continues after the whole history, k > 0 after its first k tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import collections
import concurrent.futures
import functools
import itertools
import logging
import os
import queue
from collections.abc import AsyncIterator, Iterator

from lmjax.api.batch import token_ids_of
from lmjax.api.engine_thread import EngineThread, GenOut, merge_outputs
from lmjax.api.outputs import Response, batch_offsets, lmdeploy_tokens
from lmjax.api.lmdeploy_params import (encode_first_turn, lmdeploy_batch, lmdeploy_sampling_params,
                                      special_token_ids)
from lmjax.api.pipeline import _engine_config, check_adapter
from lmjax.config import ChatTemplateConfig, SamplingParams
from lmjax.engine.engine import LLMEngine

__all__ = ["AsyncEngine", "GenOut"]
_PROBE_USER, _PROBE_REPLY = "\x01", "\x02"


class AsyncEngine:
    """`generate` (async), `stop_session`, `end_session`, `get_generator`, `batch_infer` / `__call__`."""

    def __init__(self, model_path: str | None = None, model_name: str | None = None, backend: str | None = None,
                 backend_config=None, chat_template_config: ChatTemplateConfig | None = None,
                 tp: int | None = None, log_level: str = "ERROR", **kwargs):
        logging.getLogger("lmjax").setLevel(log_level)
        if backend not in (None, "turbomind", "pytorch"):
            raise ValueError(f"backend must be 'turbomind' or 'pytorch', got {backend!r}")
        kwargs.pop("instance_num", None)  # LMDeploy's instance count: one engine serves every request here
        if kwargs:
            raise TypeError(f"AsyncEngine got unexpected arguments {sorted(kwargs)}")
        self._attach(LLMEngine(model_path, _engine_config(backend_config, tp)), model_name, chat_template_config)

    @classmethod
    def over(cls, engine: LLMEngine, chat_template_config: ChatTemplateConfig | None = None,
             model_name: str | None = None) -> AsyncEngine:
        """An AsyncEngine serving an engine already loaded (a pipeline's): from now on only its thread may
        step that engine."""
        self = cls.__new__(cls)
        self._attach(engine, model_name, chat_template_config)
        return self

    def _attach(self, engine: LLMEngine, model_name: str | None, chat_template_config) -> None:
        self.engine = engine
        self.tokenizer = self.engine.tokenizer
        self.session_len = self.engine.session_len
        self.model_name = model_name or _default_name(self.engine.model_path)
        self.chat_template = chat_template_config or ChatTemplateConfig(model_name=model_name)
        self._thread = EngineThread(self.engine)
        self.id2step = self._thread.id2step  # session id -> tokens in its kept history (LMDeploy's name)
        self._session_ids = itertools.count(1 << 40)
        self._streaming: collections.Counter = collections.Counter()  # session id -> its live _run generators
        self._aborting: dict = {}  # session id -> the Future of its abandoned turn's abort, until it is done

    # ------------------------------------------------------------------ requests
    def sampling_params(self, gen_config=None, template: ChatTemplateConfig | None = None,
                        **legacy) -> SamplingParams:
        """GenerationConfig (LMDeploy) or SamplingParams (vLLM) plus keyword settings -> SamplingParams, with
        the stop words of the chat template (`template`, or the engine's) added (lmjax.api.lmdeploy_params)."""
        return lmdeploy_sampling_params(gen_config, legacy, template or self.chat_template, self.tokenizer,
                                        self.engine.eos_token_ids)

    def encode(self, messages, sequence_start: bool = True, do_preprocess: bool = True,
               chat_template_config: ChatTemplateConfig | None = None, session_id=None) -> tuple[str, list[int]]:
        """Prompt text and ids of one turn. A later turn of a session (`sequence_start=False`) gets only the
        template text that follows the previous reply (no system prompt, no BOS), as LMDeploy does."""
        template = chat_template_config or self.chat_template
        if sequence_start:
            return encode_first_turn(self.tokenizer, messages, do_preprocess, template)
        if not do_preprocess:
            if not isinstance(messages, str):
                raise TypeError(f"with do_preprocess=False a prompt must be a str, got {type(messages).__name__}")
            return messages, self.tokenizer(messages, add_special_tokens=False)["input_ids"]
        text = self._continuation(messages, template, *self._reply_end(session_id))
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _reply_end(self, session_id) -> tuple[str | None, bool]:
        """(how the session's last reply ended, whether only that token may come off the next turn's text):
        ("", False) with no session to ask; (the EOS token's text, False) after an EOS; (the token's text, True)
        after a stop id that is a special token (a stop word such as <|im_end|> where the EOS is another, or
        InternLM2's <|action_end|>, after which the template's own end marker is still owed); (None, False)
        when the reply was cut short (max_new_tokens, a plain stop word): the end-of-reply marker is still to
        come then."""
        seq = self.engine.sessions.get(session_id)  # an idle session: the engine thread leaves it alone
        if seq is None:
            return "", False
        last = seq.output_token_ids[-1] if seq.output_token_ids else None
        if last is None:
            return None, False
        text = self.tokenizer.convert_ids_to_tokens(last)
        if last in self.engine.eos_token_ids:
            return text, False
        stop_ids = getattr(seq.params, "stop_token_ids", None) or ()
        return (text, True) if last in stop_ids and special_token_ids(self.tokenizer, [text]) else (None, False)

    def _continuation(self, messages, template: ChatTemplateConfig, reply_end: str | None = "",
                      exact: bool = False) -> str:
        """Render a probe conversation with `messages` after a reply; keep what follows the reply, minus
        the end-of-reply marker when the model already generated it: the EOS token it ended with (Llama-3's
        <|eot_id|> is not its tokenizer's eos_token), the template's eoa or the tokenizer's eos_token; with
        `exact`, the token it ended with alone."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        full = template.messages2prompt(probe + list(messages), self.tokenizer)
        tail = full[full.rindex(_PROBE_REPLY) + 1:]
        if reply_end is None:
            return tail
        markers = (reply_end,) if exact else (reply_end, template.eoa, getattr(self.tokenizer, "eos_token", None))
        for marker in markers:
            if marker and tail.startswith(marker):
                return tail[len(marker):]
        return tail

    async def generate(self, messages, session_id: int, gen_config=None, chat_template_config=None,
                       stream_response: bool = True, sequence_start: bool = True, sequence_end: bool = True,
                       step: int = 0, do_preprocess: bool = True, input_ids: list[int] | None = None,
                       stop: bool | str | list[str] | None = None, adapter_name: str | None = None,
                       vllm_outputs: bool = False, **legacy) -> AsyncIterator[GenOut]:
        """Yield GenOuts: with `stream_response`, one per step carrying the new text (`response`) and
        `token_ids`; otherwise one per completion at the end, with the whole text. Raises ValueError
        (before any work) for a bad prompt or setting, e.g. one over session_len. The token that stopped a
        reply is left out of its token_ids, logprobs and generate_token_len, as LMDeploy does;
        `vllm_outputs` (lmjax's, for the OpenAI server) keeps it, as vLLM does."""
        check_adapter(adapter_name)
        if isinstance(stop, bool):  # LMDeploy's old `stop=True`: stop the session's running turn
            if stop:
                await self.stop_session(session_id)
                return
        elif stop is not None:
            legacy["stop_words"] = [stop] if isinstance(stop, str) else list(stop)
        params = self.sampling_params(gen_config, chat_template_config, **legacy)  # this call's template's stop words
        await self.settle(session_id)  # before encode: a later turn's text depends on how the last one ended
        if input_ids is not None:
            text, ids = None, token_ids_of(input_ids, "input_ids")
        else:
            text, ids = self.encode(messages, sequence_start, do_preprocess, chat_template_config, session_id)
        if params.guided_decoding is not None:
            await asyncio.to_thread(self._compile_guides, [params])
        run = self._run(session_id, ids, params, text, sequence_start, sequence_end, stream_response, step)
        try:
            async for out in run:
                yield out if vllm_outputs else _lmdeploy_out(out, params.include_stop_str_in_output)
        finally:
            await run.aclose()  # now, with this generator's own close: not one more loop round later

    async def settle(self, session_id: int) -> None:
        """Before a turn is encoded: a stream of this session left by `break` is closed (its turn aborted) by a
        task that asyncio's finalizer hook creates a loop round later and runs the round after: let it run.
        Then wait until the engine thread has done the abort of any abandoned turn (broken off, cancelled,
        timed out, or left by a closed event loop), so the next turn sees the session as that abort left it
        (history, how its reply ended) and does not reach a busy session."""
        for _ in range(3):
            if not self._streaming[session_id]:
                break
            await asyncio.sleep(0)
        pending = self._aborting.get(session_id)
        if pending is not None:  # (shielded: cancelling this waiter must not cancel the abort others wait for)
            await asyncio.shield(asyncio.wrap_future(pending))

    async def _run(self, session_id, ids, params, text, sequence_start, sequence_end, stream,
                   step: int = 0) -> AsyncIterator[GenOut]:
        loop, items = asyncio.get_running_loop(), asyncio.Queue()
        sink = lambda item: loop.call_soon_threadsafe(items.put_nowait, item)  # noqa: E731
        request_id = self._thread.submit(session_id, ids, params, text, sequence_start, sequence_end, sink, step)
        finished, whole = False, {}
        self._streaming[session_id] += 1
        try:
            while (item := await items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if stream:
                    yield item
                else:
                    whole[item.index] = merge_outputs(whole.get(item.index), item)
            finished = True
            for index in sorted(whole):
                yield whole[index]
        finally:
            self._streaming[session_id] -= 1
            if not self._streaming[session_id]:
                del self._streaming[session_id]
            if not finished:  # cancelled, disconnected or abandoned: free its blocks
                self._note_abort(session_id, self._thread.abort(request_id))

    def _note_abort(self, session_id, done: concurrent.futures.Future) -> None:
        """Keep the abort's Future for the session's next turn (`settle`) until it is done."""
        self._aborting[session_id] = done
        done.add_done_callback(lambda f: self._aborting.pop(session_id, None) if self._aborting.get(session_id) is f
                               else None)

    def stop_session(self, session_id: int) -> _Done:
        """Stop the session's running turn (its history so far is kept). Await the result, or
        `.result()` it, to wait until the engine has done it; the session's next turn waits for it anyway."""
        return self._session_command(session_id, self._thread.stop_session)

    def end_session(self, session_id: int) -> _Done:
        """Stop the session's running turn and forget its history, freeing its KV cache."""
        return self._session_command(session_id, self._thread.end_session)

    def _session_command(self, session_id: int, command) -> _Done:
        """Run command(session_id) on the engine thread; the session's next turn is encoded only after it (an
        un-awaited stop, or get_generator(stop=True)'s, would otherwise leave the turn's text to guess how the
        stopped reply ended)."""
        done = self._thread.call(lambda: command(session_id))
        self._note_abort(session_id, done)
        return _Done.of(done)

    def get_generator(self, stop: bool, session_id: int) -> SessionGenerator:
        """A handle bound to one session (`stop=True` first stops its running turn)."""
        if stop:
            self.stop_session(session_id)
        return SessionGenerator(self, session_id)

    # ------------------------------------------------------------------ synchronous batch
    def batch_infer(self, prompts, gen_config=None, do_preprocess: bool = True,
                    chat_template_config: ChatTemplateConfig | None = None, adapter_name: str | None = None,
                    **legacy) -> Response | list[Response]:
        """Run a batch to completion from synchronous code (any thread; not inside the engine thread).
        A Response's `index` is its prompt's position (completion i of n > 1: position * n + i).
        `chat_template_config`: this call's template instead of the engine's."""
        check_adapter(adapter_name)
        single, encoded, params = self._batch(prompts, gen_config, do_preprocess, legacy, chat_template_config)
        sinks = [queue.SimpleQueue() for _ in encoded]
        self._add_many(encoded, params, [s.put for s in sinks])
        offsets = batch_offsets([sp.n for sp in params])
        out = [r for p, (s, sp) in enumerate(zip(sinks, params)) for r in _drain(s, offsets[p], sp)]
        return out[0] if single and len(out) == 1 else out

    __call__ = batch_infer

    def stream_infer(self, prompts, gen_config=None, do_preprocess: bool = True,
                     chat_template_config: ChatTemplateConfig | None = None, adapter_name: str | None = None,
                     **legacy) -> Iterator[Response]:
        """Synchronous streaming of a prompt or a batch (as `batch_infer` takes them): Responses carrying
        the new text of one completion, `index` as in `batch_infer`."""
        check_adapter(adapter_name)
        _, encoded, params = self._batch(prompts, gen_config, do_preprocess, legacy, chat_template_config)
        items: queue.SimpleQueue = queue.SimpleQueue()
        rids = self._add_many(encoded, params, [functools.partial(_tagged, items.put, p) for p in range(len(encoded))])
        offsets = batch_offsets([sp.n for sp in params])
        left, done = len(encoded), False
        try:
            while left:
                p, item = items.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield _response(_lmdeploy_out(item, params[p].include_stop_str_in_output),
                                    index=offsets[p] + item.index)
            done = True
        finally:
            if not done:
                for rid in rids:
                    self._thread.abort(rid)

    def _batch(self, prompts, gen_config, do_preprocess: bool, legacy: dict, template=None):
        """(single prompt?, [(text, ids)], [SamplingParams]) of a prompt or a batch of them."""
        return lmdeploy_batch(prompts, gen_config, legacy, do_preprocess, template or self.chat_template,
                              self.tokenizer, self.engine.eos_token_ids)

    def _compile_guides(self, params: list[SamplingParams]) -> None:
        """Compile new guides in the calling thread: the engine thread's check at submission would compile
        them there (a JSON schema: up to ~0.3 s), stalling every running stream; it then finds them cached.
        A guide that cannot compile raises its ValueError here, as that check would."""
        for p in params:
            if p.guided_decoding is not None:
                self.engine.guided.index(p.guided_decoding)

    def submit_batch(self, encoded, params, sinks) -> list[str]:
        """Queue a batch of (text, token ids) prompts with their SamplingParams, each request's outputs (GenOut,
        then None at its end, or an exception) handed to its sink on the engine thread; every request is
        checked before any is queued and all are queued between two steps. Their request ids (for `abort`)."""
        return self._add_many(encoded, params, sinks)

    def abort(self, request_ids) -> None:
        """Cancel requests by id (a finished one's abort does nothing)."""
        for rid in request_ids:
            self._thread.abort(rid)

    def _add_many(self, encoded, params, sinks) -> list[str]:
        """Queue a batch (every request checked before any is queued); its request ids."""
        self._compile_guides(params)
        return self._thread.call(lambda: self._thread.add_many(
            [(next(self._session_ids), ids, p, text, s) for (text, ids), p, s in zip(encoded, params, sinks)]
        )).result()

    def stats(self) -> dict:
        """The engine's counters (read without locking: a snapshot, good for metrics)."""
        return self.engine.stats()

    def finished_reasons(self) -> dict[str, int]:
        """How many completions finished with each finish reason (stop, length, abort, error)."""
        return dict(self._thread.finished)

    def close(self) -> None:
        self._thread.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SessionGenerator:
    """What `get_generator` returns: `generate`, `stop` and `end` bound to one session."""

    def __init__(self, engine: AsyncEngine, session_id: int):
        self.engine, self.session_id = engine, session_id

    def generate(self, messages, **kwargs) -> AsyncIterator[GenOut]:
        return self.engine.generate(messages, self.session_id, **kwargs)

    def stop(self):
        return self.engine.stop_session(self.session_id)

    def end(self):
        return self.engine.end_session(self.session_id)


class _Done(concurrent.futures.Future):
    """A Future that can also be awaited (LMDeploy's stop/end_session are coroutines in newer versions)."""

    @classmethod
    def of(cls, future: concurrent.futures.Future) -> _Done:
        done = cls()  # (set as `future` ends, unless its waiter cancelled it: the engine did the command anyway)
        future.add_done_callback(lambda f: done.set_running_or_notify_cancel() and (
            done.set_exception(f.exception()) if f.exception() is not None else done.set_result(f.result())))
        return done

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _response(out: GenOut, session_id: int | None = None, index: int | None = None) -> Response:
    return Response(out.response, out.generate_token_len, out.input_token_len, out.finish_reason,
                    list(out.token_ids), out.logprobs, out.logits, out.last_hidden_state,
                    out.index if index is None else index, session_id)


def _tagged(put, position: int, item) -> None:
    put((position, item))


def _drain(sink: queue.SimpleQueue, offset: int, params: SamplingParams) -> list[Response]:
    whole: dict[int, GenOut] = {}
    while (item := sink.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        whole[item.index] = merge_outputs(whole.get(item.index), item)
    return [_response(_lmdeploy_out(whole[i], params.include_stop_str_in_output),
                      index=offset + i) for i in sorted(whole)]


def _lmdeploy_out(out: GenOut, include_stop: bool) -> GenOut:
    """A GenOut as LMDeploy's AsyncEngine gives it: without the token that stopped the reply (outputs.py)."""
    if out.stop_token_id is None:
        return out
    rows = {"logits": out.logits, "last_hidden_state": out.last_hidden_state}
    ids, logprobs, count, rows = lmdeploy_tokens(list(out.token_ids), out.logprobs, out.generate_token_len, rows,
                                                 out.stop_token_id, include_stop)
    return dataclasses.replace(out, token_ids=ids, logprobs=logprobs, generate_token_len=count, **rows)


def _default_name(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    return name[:-5] if name.endswith(".gguf") else name
