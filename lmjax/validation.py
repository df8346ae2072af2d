"""Validation helpers of the user-facing config dataclasses (lmjax.config): strict keyword checking, and
the checks a field needs that are too long to sit inline in a `__post_init__`.

Errors name the offending value: `ValueError("top_p must be in (0, 1], got 0")`; an unknown keyword is a
`TypeError` that lists it and suggests the nearest valid field.
"""
from __future__ import annotations

import difflib
import functools
import math
from dataclasses import fields
from numbers import Integral, Real


def strict_fields(cls):
    """Wrap `cls.__init__` so unknown keywords fail with every bad name and a suggestion."""
    init, names = cls.__init__, [f.name for f in fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            hint = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
            raise TypeError(f"{cls.__name__} got unknown field(s) {unknown}"
                            + (f" ({hint})" if hint else "") + f"; valid fields: {names}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


# numpy.finfo(numpy.float32).max (numpy stays out of config imports): the sampler computes in float32, where a
# larger finite float becomes inf and turns a row's logits to NaN (-inf / inf under a ban, say)
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny, its smallest normal: 1 / it is finite


def is_int(value) -> bool:
    """An integer (numpy's too) and not a bool (an int to Python): 8.0 and True are no block count or policy."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_token_ids(what: str, token_ids, vocab: int) -> None:
    """A ValueError naming the ids outside the vocabulary [0, vocab) (the device would drop or clamp them
    without a word). The engine's prompt checks and the research helpers (lmjax.models.forward) share it."""
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})")


def check_bools(obj, names: tuple[str, ...]) -> None:
    """Each named field of `obj` is True or False (a str "no" would read as true), naming the one that is not."""
    for name in names:
        value = getattr(obj, name)
        check(isinstance(value, bool), f"{name} must be True or False, got {type(value).__name__} {value!r}")


def check_logit_bias(logit_bias) -> dict[int, float] | None:
    """SamplingParams.logit_bias as a fresh {token id: bias} dict (None stays None). Keys must be integer
    ids (not the strings of OpenAI's JSON: the server converts those, lmjax.serve.protocol), values finite
    numbers. Like vLLM's SamplingParams, the bias is not clamped here (OpenAI's [-100, 100] is the server's
    rule); ids outside the vocabulary are caught when the request is submitted (the vocabulary is the
    engine's to know)."""
    if logit_bias is None:
        return None
    check(isinstance(logit_bias, dict), f"logit_bias must be a dict {{token id: bias}}, got {logit_bias!r}")
    bad_keys = [k for k in logit_bias if not isinstance(k, Integral) or isinstance(k, bool)]
    check(not bad_keys, f"logit_bias keys must be int token ids, got {bad_keys[:5]!r}")
    bad = {k: v for k, v in logit_bias.items()
           if not isinstance(v, Real) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > FLOAT32_MAX}
    check(not bad, f"logit_bias values must be finite numbers, got {dict(list(bad.items())[:5])!r} "
                   f"(float32's range: |bias| <= {FLOAT32_MAX:.6g})")
    return {int(k): float(v) for k, v in logit_bias.items()}


def check_defaults_only(owner: str, values: dict, defaults: dict) -> None:
    """Arguments kept for code written against vLLM or LMDeploy that lmjax does not implement: their
    default values pass, anything else is a NotImplementedError naming it (never silently ignored).
    `values`: {name: value} of `owner`'s (a class name) arguments, each a key of `defaults`."""
    for name, value in values.items():
        if value != defaults[name]:
            raise NotImplementedError(f"{owner}({name}={value!r}) is not supported by lmjax")


@functools.cache
def warn_once(message: str) -> None:
    import logging

    logging.getLogger("lmjax").warning(message)


def warn_no_effect(owner: str, name: str, value, why: str) -> None:
    """A setting that only tunes an engine lmjax does not have: accepted, logged once per value."""
    warn_once(f"{owner}({name}={value!r}) has no effect in lmjax: {why}")


def as_list(value, name: str, item_type: type) -> list | None:
    """None stays None; a lone item becomes a one-element list; items must be `item_type`."""
    if value is None:
        return None
    iterable = hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))
    items = [value] if isinstance(value, item_type) else list(value) if iterable else [value]
    bad = [v for v in items if not isinstance(v, item_type) or isinstance(v, bool)]
    check(not bad, f"{name} must hold {item_type.__name__} values, got {value!r}")
    if item_type is str:
        for item in items:
            check_text(item, name)
    return items


def check_text(text: str, where: str) -> str:
    """`text` if it can be encoded as UTF-8, else a ValueError naming `where` and the offending characters (a
    lone surrogate: the tokenizer's own error names neither)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid text: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None
    return text


def check_numbers(obj, names: tuple[str, ...]) -> None:
    """Each named field a real number (a str such as "0.5" would fail later with an error naming nothing)."""
    for name in names:
        value = getattr(obj, name)
        check(isinstance(value, (int, float)) and not isinstance(value, bool),
              f"{name} must be a number, got {value!r}")
