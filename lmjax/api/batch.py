"""What both facades share: turning user prompts into token ids, and running a batch of requests on the
engine to completion (every request validated before any is queued, results in input order)."""
from __future__ import annotations

import logging
import threading
from numbers import Integral
from collections.abc import Sequence

from tqdm.auto import tqdm

from lmjax.config import ChatTemplateConfig, SamplingParams
from lmjax.engine.engine import LLMEngine
from lmjax.engine.request import Request
from lmjax.validation import check_text

Messages = list[dict]
logger = logging.getLogger("lmjax.engine")


def is_token_id(t) -> bool:
    """An int or a numpy integer (ids often come from an array); not a bool, which is an int to Python."""
    return isinstance(t, Integral) and not isinstance(t, bool)


def token_ids_of(ids, where: str) -> list[int]:
    """A prompt's token ids as plain ints; a TypeError naming the first entry that is not one."""
    ids = list(ids)
    bad = next((i for i, t in enumerate(ids) if not is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"{where}[{bad}] must be an int token id, got {ids[bad]!r} ({type(ids[bad]).__name__})")
    return [int(t) for t in ids]


def token_id_lists(input_ids, where: str) -> list[list[int]]:
    """One sequence of token ids (a list or array of them) or a list of such, as lists of ints (each checked)."""
    one = len(input_ids) > 0 and is_token_id(input_ids[0])
    if one:
        return [token_ids_of(input_ids, where)]
    return [token_ids_of(x, f"{where}[{i}]") for i, x in enumerate(input_ids)]


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw prompt: the tokenizer adds its special tokens (BOS) as for any plain text."""
    return tokenizer(check_text(text, "prompt"))["input_ids"]


def encode_chat(tokenizer, messages: str | Messages, template: ChatTemplateConfig | None,
                **switches) -> tuple[str, list[int]]:
    """A first turn through the template. switches: add_generation_prompt / continue_final_message and Jinja
    template arguments (`ChatTemplateConfig.messages2prompt`). A Jinja template's text holds any BOS it wants
    (tokenized without special tokens, as vLLM does); LMDeploy's role markers and plain text hold none: the
    tokenizer adds its own, as LMDeploy's encode(prompt, add_bos=True) does."""
    template = template or ChatTemplateConfig()
    text = template.messages2prompt(messages, tokenizer, **switches)
    jinja = template.renders_jinja(messages, tokenizer, switches.get("chat_template"))
    return text, tokenizer(text, add_special_tokens=not jinja)["input_ids"]


def check_kind(value, kind: type | tuple[type, ...], name: str) -> None:
    """A TypeError naming the argument (`name`, with its position for a per-prompt entry: "gen_config[1]") and
    the type it got, where a wrong one (a dict for a SamplingParams) would fail deep in the engine with an
    AttributeError that names neither."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        wanted = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
        raise TypeError(f"{name} must be a {wanted}, got {type(value).__name__}")


def per_prompt(value, count: int, name: str, kind: type | tuple[type, ...] | None = None) -> list:
    """One value for every prompt, or a list with one per prompt; with `kind`, each checked to be one."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        for i, v in enumerate(value if kind is not None else ()):
            check_kind(v, kind, f"{name}[{i}]")
        return list(value)
    if kind is not None:
        check_kind(value, kind, name)
    return [value] * count


def submit_all(engine: LLMEngine, prompts: Sequence[tuple[str | None, list[int]]],
               params: Sequence[SamplingParams], overflow_as_length: bool = False) -> list[Request]:
    """Queue every request, but only after all of them passed validation: a bad one costs no work and
    leaves no other request queued. `overflow_as_length` (LMDeploy's facades): a prompt that leaves no
    room in session_len is not an error but a request already finished with reason "length"."""
    for i, p in enumerate(params):
        check_kind(p, SamplingParams, f"sampling_params[{i}]")
    overflowed = engine.validate_batch([(ids, p) for (_, ids), p in zip(prompts, params)])
    if overflowed and not overflow_as_length:
        raise next(iter(overflowed.values()))
    requests: list[Request] = []
    try:
        for i, ((text, ids), p) in enumerate(zip(prompts, params)):
            requests.append(engine.overflowed_request(ids, p, overflowed[i], text) if i in overflowed
                            else engine.add_request(ids, p, prompt=text))
    except BaseException:  # one failing past validation (or Ctrl-C): the batch's queued ones go too (vLLM's)
        for r in requests:
            engine.abort(r.request_id)
        raise
    return requests


class Stopped(Exception):
    """A batch given up by its caller (Ctrl-C while waiting for it on another thread): its requests aborted."""


def run_to_completion(engine: LLMEngine, requests: list[Request], use_tqdm: bool = False,
                      stop: threading.Event | None = None) -> list[Request]:
    """Step the engine until every request is finished; `stop` set (between steps) aborts them (Stopped)."""
    bar = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm)
    done: set[str] = set()
    try:
        while not all(r.finished for r in requests):
            if stop is not None and stop.is_set():
                raise Stopped(f"{len(requests)} requests stopped by their caller")
            for r in engine.step():
                if r.finished and r.request_id not in done:
                    done.add(r.request_id)
                    bar.update(1)
    except BaseException:
        for r in requests:
            engine.abort(r.request_id)
        raise
    finally:
        bar.close()
    logger.info("batch done: %s", engine.stats())
    return requests
