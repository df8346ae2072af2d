"""A regex or choice guide as a regex for outlines-core (lmjax.engine.guided compiles it over the vocabulary): a
choice as an alternation of escaped strings, a regex with its anchors stripped and `\\d` made ASCII, both bounded
in size. (JSON schemas, json_object, grammars and structural tags are llguidance's: lmjax.engine.guided_json and
lmjax.engine.guided_grammar.)"""
from __future__ import annotations

import math
import re

from lmjax.guided_params import GuidedDecodingParams

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


# ------------------------------------------------------------------ params -> regex

def _escape(text: str) -> str:
    """A literal for outlines' (Rust) regex syntax: its metacharacters escaped, nothing else."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def ascii_digits(regex: str) -> str:
    """`\\d` as the ASCII digits [0-9], as JSON Schema patterns and xgrammar read it. Rust's regex (and so
    outlines) reads it as any Unicode digit, and SmolLM2 asked for r"\\d{3}" greedily wrote "🯸🯸🯸"."""
    return narrowed_class(regex, "d", "0-9")


def narrowed_class(regex: str, letter: str, members: str) -> str:
    """The regex with the class escape `\\<letter>` (outside or inside brackets) as the class `members`."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            out.append((members if in_class else f"[{members}]") if regex[i + 1] == letter else regex[i:i + 2])
            i += 2
            continue
        in_class = (c == "[") or (in_class and c != "]")
        out.append(c)
        i += 1
    return "".join(out)


# What one guide may ask of outlines-core, whose automaton grows with a regex's expanded size (a counted
# repeat multiplies its body; measured: {"minLength": 10**9} reached 20 GB, 50 nested arrays 24 GB): a guide
# past these is a ValueError naming its size, before any large allocation.
MAX_GUIDE_SIZE = 100_000  # regex characters after expanding counted repeats (a broad class counts more)
# A class most tokens fit in costs far more than a literal: each of its automaton states lists nearly the whole
# vocabulary (SmolLM2's 49k tokens, outlines-core 0.2.14, a unit of `a{0,2000}` 0.35 ms; `.` and `[^"]` 30-40 ms
# and ~2 MB, `\w` 160 ms, `\p{L}` 95 ms: `.{0,4000}` passed the bound and aborted the process at 6 GB). Weights
# about four times those ratios bound a guide's compile to ~10 s and its memory to ~0.5 GB at this vocabulary.
BROAD_WEIGHT = 400  # `.`, a negated class ([^"], \S, \W, \D), a negated literal
UNICODE_WEIGHT = 1600  # `\w`, `\p{..}` / `\P{..}`: Unicode letter classes in outlines' (Rust) regex
_CHEAP_CATEGORIES = {"CATEGORY_DIGIT", "CATEGORY_SPACE"}  # (\d is ASCII here: ascii_digits)
_UNICODE_CLASS = re.compile(r"\\[pP](\{[^}]*\}|[A-Za-z])")  # Python's parser lacks \p: sized as \w


def guide_regex(guided: GuidedDecodingParams) -> str:
    regex = _regex(guided)
    size = len(regex) if len(regex) > MAX_GUIDE_SIZE else expanded_size(ascii_digits(regex))  # cheap test first
    if size > MAX_GUIDE_SIZE:
        raise ValueError(f"guided decoding {guided.kind} is too large: its regex expands to about {size:,} "
                         f"characters (repeat counts, lengths, nesting; `.`, negated classes count {BROAD_WEIGHT} "
                         f"and Unicode classes such as \\w {UNICODE_WEIGHT}), more than the {MAX_GUIDE_SIZE:,} a "
                         "guide may compile to; an ASCII class ([A-Za-z0-9_]) costs one, and a JSON schema's "
                         "pattern / maxLength is compiled lazily")
    return ascii_digits(regex)


def expanded_size(regex: str) -> int:
    """The regex's length with each counted repeat written out ({n,m}: its body m times; an open one its
    minimum + 1) and broad classes weighted (BROAD_WEIGHT, UNICODE_WEIGHT), read with Python's regex parser; a
    regex it cannot read (Rust-only syntax) counts its length."""
    import re._parser as parser  # noqa: PLC0415  (CPython's, stable since 3.11)
    from re._constants import MAXREPEAT

    def size(items) -> int:
        total = 0
        for op, av in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, body = av
                total += (hi if hi != MAXREPEAT else lo + 1) * size(body)
            elif name in ("SUBPATTERN", "ATOMIC_GROUP"):
                total += size(av[-1])
            elif name == "BRANCH":
                total += sum(size(b) for b in av[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(av[1])
            else:
                total += _atom_weight(name, av)
            if total > MAX_GUIDE_SIZE:
                return total  # enough: no need to walk (or multiply) further
        return total
    try:
        return size(parser.parse(_UNICODE_CLASS.sub(r"\\w", regex)))
    except Exception:  # noqa: BLE001  (syntax Python's parser lacks, such as stacked repeats "x{9}{9}")
        # an upper bound only where repeats are stacked ("x{9}{9}", which Python's parser refuses), else the length
        stacked = re.search(r"\{\d+(?:,\d*)?\}\{\d+", regex)
        counts = [int(m.group(2) or m.group(1)) for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", regex)]
        return len(regex) * math.prod(min(c, MAX_GUIDE_SIZE) or 1 for c in counts) if stacked else len(regex)


def _atom_weight(name: str, av) -> int:
    """What one position of the regex costs outlines-core, in literal characters (see BROAD_WEIGHT)."""
    if name in ("ANY", "NOT_LITERAL"):
        return BROAD_WEIGHT
    if name != "IN":
        return 1
    categories = {str(arg) for op, arg in av if str(op) == "CATEGORY"}
    if "CATEGORY_WORD" in categories:
        return UNICODE_WEIGHT
    if any(str(op) == "NEGATE" for op, _ in av) or categories - _CHEAP_CATEGORIES:
        return BROAD_WEIGHT
    return 1


def strip_anchors(regex: str) -> str:
    """The regex less a leading `^` / `\\A` and a trailing (unescaped) `$` / `\\z`: a guide always matches the
    whole output, and outlines' Index rejects a `^` ("anchored universal start state doesn't exist"), while
    users write r"^\\d{3}$" (vLLM's xgrammar and guidance backends take it)."""
    if regex.startswith("^"):
        regex = regex[1:]
    elif regex.startswith("\\A"):
        regex = regex[2:]
    for end in ("$", "\\z"):
        head = regex[:-len(end)]
        if regex.endswith(end) and (len(head) - len(head.rstrip("\\"))) % 2 == 0:  # not itself escaped
            return head
    return regex


def _regex(guided: GuidedDecodingParams) -> str:
    kind = guided.kind
    if kind == "regex":
        return strip_anchors(guided.regex)
    if kind == "choice":
        return "(" + "|".join(_escape(c) for c in guided.choice) + ")"
    raise ValueError(f"guided decoding {kind} is not a regex guide (lmjax.engine.guided_json guides JSON)")
