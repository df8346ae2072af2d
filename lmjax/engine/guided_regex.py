"""A request's guide as a regex for outlines-core (lmjax.engine.guided compiles it over the vocabulary): a JSON
schema through outlines' build_regex_from_schema (its integers' minimum / maximum, which outlines ignores, put
back as exact ranges), a choice as an alternation of escaped strings, a regex with its anchors stripped and `\\d`
made ASCII. (json_object and the schemas outlines cannot enforce go to llguidance: lmjax.engine.guided_grammar.)"""
from __future__ import annotations

import json
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
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            out.append(("0-9" if in_class else "[0-9]") if regex[i + 1] == "d" else regex[i:i + 2])
            i += 2
            continue
        in_class = (c == "[") or (in_class and c != "]")
        out.append(c)
        i += 1
    return "".join(out)


# What one guide may ask of outlines-core, whose automaton grows with a regex's expanded size (a counted
# repeat multiplies its body; measured: {"minLength": 10**9} reached 20 GB, 50 nested arrays 24 GB): a guide
# past these is a ValueError naming its size, before any large allocation.
MAX_GUIDE_SIZE = 100_000  # regex characters after expanding counted repeats
MAX_INTEGER_BOUND = 10**18  # |minimum| / |maximum| of a JSON integer (beyond int64 a bound means nothing)


def guide_regex(guided: GuidedDecodingParams) -> str:
    regex = _regex(guided)
    size = len(regex) if len(regex) > MAX_GUIDE_SIZE else expanded_size(ascii_digits(regex))  # cheap test first
    if size > MAX_GUIDE_SIZE:
        raise ValueError(f"guided decoding {guided.kind} is too large: its regex expands to about {size:,} "
                         f"characters (repeat counts, lengths, nesting), more than the {MAX_GUIDE_SIZE:,} a guide "
                         "may compile to")
    return ascii_digits(regex)


def expanded_size(regex: str) -> int:
    """The regex's length with each counted repeat written out ({n,m}: its body m times; an open one its
    minimum + 1), read with Python's regex parser; a regex it cannot read (Rust-only syntax) counts its length."""
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
                total += 1
            if total > MAX_GUIDE_SIZE:
                return total  # enough: no need to walk (or multiply) further
        return total
    try:
        return size(parser.parse(regex))
    except Exception:  # noqa: BLE001  (syntax Python's parser lacks, such as stacked repeats "x{9}{9}")
        # an upper bound only where repeats are stacked ("x{9}{9}", which Python's parser refuses), else the length
        stacked = re.search(r"\{\d+(?:,\d*)?\}\{\d+", regex)
        counts = [int(m.group(2) or m.group(1)) for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", regex)]
        return len(regex) * math.prod(min(c, MAX_GUIDE_SIZE) or 1 for c in counts) if stacked else len(regex)


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
    from outlines_core.json_schema import build_regex_from_schema

    check_keywords(json.loads(guided.json))
    check_nesting(json.loads(guided.json))
    schema, ranges = _bounded_integers(json.loads(guided.json))
    regex = build_regex_from_schema(json.dumps(schema) if ranges else guided.json, guided.whitespace)
    for placeholder, (lo, hi) in ranges.items():  # each stands for one bounded integer (see _bounded_integers)
        regex = regex.replace(f'"{placeholder}"', integer_range_regex(lo, hi))
    return regex


# ------------------------------------------------------------------ what a JSON schema may ask

_NOT_SCHEMAS = {"const", "enum", "default", "examples"}  # keys whose values are data, not subschemas
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}  # names (patterns) to subschemas
# Keywords outlines-core's regex leaves out (checked with outlines-core 0.2.14) that llguidance enforces: a schema
# using one is guided by llguidance instead (lmjax.engine.guided), as vLLM's "auto" falls back from xgrammar to
# guidance. Number bounds (minimum / maximum on a non-integer) likewise; integer bounds outlines' regex takes here.
LLGUIDANCE_KEYWORDS = {"multipleOf", "patternProperties", "minProperties", "maxProperties"}
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
# Keywords neither enforces (llguidance 1.9: "Unimplemented keys"): refused by name, as vLLM refuses what its
# backend cannot enforce, not ignored (a guide would let JSON through that breaks them).
UNSUPPORTED_KEYWORDS = {"uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
                        "dependentRequired", "dependentSchemas", "if", "then", "else"}


def schema_nodes(schema):
    """Every subschema of `schema` (itself included), at any depth (property names are not keywords)."""
    if isinstance(schema, list):
        for value in schema:
            yield from schema_nodes(value)
    elif isinstance(schema, dict):
        yield schema
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    yield from schema_nodes(sub)
            elif key not in _NOT_SCHEMAS:
                yield from schema_nodes(value)


def check_keywords(schema) -> None:
    """A ValueError naming the keywords of `schema` (at any depth) that no guide can enforce."""
    found = {key for node in schema_nodes(schema) for key in node if key in UNSUPPORTED_KEYWORDS}
    if found:
        raise ValueError(f"JSON schema keywords {sorted(found)} are not supported by guided decoding (the guide "
                         "could not enforce them)")


def needs_llguidance(schema) -> bool:
    """Whether `schema` asks what outlines-core's regex cannot hold and llguidance can: LLGUIDANCE_KEYWORDS or
    bounds on a value that may be a non-integer number."""
    for node in schema_nodes(schema):
        if LLGUIDANCE_KEYWORDS & node.keys():
            return True
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            raise ValueError(f"JSON schema \"type\" must be a string or a list of strings, got {node['type']!r}")
        if _BOUNDS & node.keys() and not (types and set(types) <= {"integer", "null"}):
            return True
    return False


MAX_NESTING = 10  # outlines-core writes an array's items twice, an object's optional properties in each order:
# its regex grows 2-4x a level (40 nested arrays: a 2**40-character regex), so nesting is bounded before it is built


def check_nesting(schema) -> None:
    """A ValueError for objects and arrays nested deeper than MAX_NESTING."""
    def depth(node) -> int:
        if isinstance(node, list):
            return max((depth(v) for v in node), default=0)
        if not isinstance(node, dict):
            return 0
        inner = max((depth(v) for k, v in node.items() if k not in _NOT_SCHEMAS), default=0)
        container = node.get("type") in ("array", "object") or any(k in node for k in ("items", "prefixItems",
                                                                                       "properties"))
        return inner + container
    levels = depth(schema)
    if levels > MAX_NESTING:
        raise ValueError(f"JSON schema objects / arrays nested {levels} deep: guided decoding takes at most "
                         f"{MAX_NESTING}")


# ------------------------------------------------------------------ integer minimum / maximum


def _bounded_integers(schema) -> tuple[object, dict[str, tuple[int | None, int | None]]]:
    """outlines-core ignores minimum / maximum (its integer is any integer: SmolLM2 wrote 100000... for
    {"minimum": 1, "maximum": 9}). Each {"type": "integer"} subschema with bounds becomes a string const
    placeholder, which `_regex` replaces in outlines' regex by `integer_range_regex`; (schema, {placeholder:
    (lo, hi)}), the schema unchanged when nothing is bounded."""
    ranges: dict[str, tuple[int | None, int | None]] = {}

    def bounds(node: dict) -> tuple[int | None, int | None] | None:
        if node.get("type") != "integer" or "enum" in node or "const" in node:
            return None
        lo = hi = None
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not \
                    (math.isfinite(value) and abs(value) <= MAX_INTEGER_BOUND):
                raise ValueError(f"integer {key}={value} is out of range: guided decoding takes integer bounds "
                                 f"within ±{MAX_INTEGER_BOUND:.0e}")
        for key, exclusive in (("minimum", "exclusiveMinimum"), ("exclusiveMinimum", None)):
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                strict = key == "exclusiveMinimum" or node.get(exclusive) is True  # draft 4's boolean form
                value = math.floor(value) + 1 if strict else math.ceil(value)
                lo = value if lo is None else max(lo, value)
        for key, exclusive in (("maximum", "exclusiveMaximum"), ("exclusiveMaximum", None)):
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                strict = key == "exclusiveMaximum" or node.get(exclusive) is True
                value = math.ceil(value) - 1 if strict else math.floor(value)
                hi = value if hi is None else min(hi, value)
        if lo is None and hi is None:
            return None
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"integer bounds leave no value: {json.dumps(node)}")
        return lo, hi

    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        types = node.get("type")
        bounded = any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
        if bounded and isinstance(types, list) and "integer" in types:  # ["integer", "null"]: per type
            rest = {k: v for k, v in node.items() if k != "type"}
            return walk({"anyOf": [{**rest, "type": t} for t in types]})
        found = bounds(node)
        if found is not None:
            placeholder = f"LMJAXINTRANGE{len(ranges)}Q"
            ranges[placeholder] = found
            return {"const": placeholder}
        return {k: v if k in _NOT_SCHEMAS else walk(v) for k, v in node.items()}

    out = walk(schema)
    return (out, ranges) if ranges else (schema, {})


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex (one group) of the JSON integers in [lo, hi] (None: unbounded), written without leading zeros
    or "-0", as outlines' own integer regex."""
    parts = []
    if lo is None or lo < 0:  # negative values: "-" and their magnitudes
        low = 1 if hi is None or hi >= 0 else -hi
        high = None if lo is None else -lo
        if high is None or high >= low:
            parts.append("-" + _natural_range(low, high))
    if hi is None or hi >= 0:
        parts.append(_natural_range(0 if lo is None else max(lo, 0), hi))
    return "(" + "|".join(parts) + ")"


def _natural_range(lo: int, hi: int | None) -> str:
    """A group of the numbers lo..hi (hi None: no end) in decimal without leading zeros."""
    if hi is None:  # lo and up: lo..99..9 of lo's length, then any longer number
        digits = len(str(lo))
        return f"({_natural_range(lo, 10 ** digits - 1)[1:-1]}|[1-9][0-9]{{{digits},}})"
    alternatives = []
    for length in range(len(str(lo)), len(str(hi)) + 1):
        start = max(lo, 10 ** (length - 1) if length > 1 else 0)
        end = min(hi, 10 ** length - 1)
        if start <= end:
            alternatives += _same_length(str(start), str(end))
    return "(" + "|".join(alternatives) + ")"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives (each a plain concatenation) matching the numbers lo..hi, both of one length."""
    if lo == hi:
        return [lo]
    if len(lo) == 1:
        return [f"[{lo}-{hi}]"]
    if lo[0] == hi[0]:
        return [lo[0] + p for p in _same_length(lo[1:], hi[1:])]
    rest, out, tail = len(lo) - 1, [], []
    first = int(lo[0])
    if lo[1:] != "0" * rest:
        out, first = [lo[0] + p for p in _same_length(lo[1:], "9" * rest)], first + 1
    last = int(hi[0])
    if hi[1:] != "9" * rest:
        tail, last = [hi[0] + p for p in _same_length("0" * rest, hi[1:])], last - 1
    if first <= last:
        out.append(f"[{first}-{last}][0-9]{{{rest}}}")
    return out + tail
