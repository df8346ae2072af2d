"""Guides whose size grows fast with their spec compile in bounded time and memory. JSON schemas were outlines-core
regexes until session 28: nested objects with optional properties grew the regex ~4x a level (a 1 KB schema cost
minutes and GBs before a "too large" refusal); llguidance builds them lazily, so a deep schema now compiles at
once and guides. A regex guide's size bound stays (outlines-core builds the automaton eagerly)."""
import subprocess
import sys
import textwrap
import time

import pytest

from char_tokenizer import CharTokenizer
from lmjax import GuidedDecodingParams, SamplingParams
from lmjax.engine.guided import GuidedDecoding
from lmjax.engine.guided_regex import guide_regex

CHARS = list('0123456789-{}[]":, ab')


def nested_objects(n):
    s = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s, "b": {"type": "integer"}}}
    return s


def _params(**guide):
    return SamplingParams(guided_decoding=GuidedDecodingParams(**guide))


def _walks(guided, params, text) -> bool:
    state = guided.new_state(params, None)
    for c in text:
        t = CHARS.index(c) + 1
        if not (state.mask_W()[t >> 5] >> (t & 31)) & 1:
            return False
        state.advance(t)
    return state.complete


def test_a_deep_schema_compiles_at_once_and_guides():
    guided = GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])
    start = time.perf_counter()
    params = _params(json=nested_objects(20), disable_any_whitespace=True)
    guided.check(params)
    assert time.perf_counter() - start < 2.0, f"compiling took {time.perf_counter() - start:.1f} s"
    deep = '{"a":' * 20 + "1" + "}" * 20
    assert _walks(guided, params, deep) and _walks(guided, params, '{"b":2}')
    assert not _walks(guided, params, '{"a":{"a":"x"}}')


def test_a_deep_schema_compiles_within_a_small_address_space():
    """Under a 2 GB address-space limit the compile still ends, in a few seconds (outlines' regex did not)."""
    code = textwrap.dedent("""
        import resource, sys
        sys.path.insert(0, "tests")
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from char_tokenizer import CharTokenizer
        from lmjax import GuidedDecodingParams, SamplingParams
        from lmjax.engine.guided import GuidedDecoding
        s = {"type": "integer"}
        for _ in range(40):
            s = {"type": "object", "properties": {"a": s, "b": {"type": "integer"}}}
        chars = list('0123456789-{}[]":, ab')
        GuidedDecoding(CharTokenizer(chars), len(chars) + 1, [0]).check(
            SamplingParams(guided_decoding=GuidedDecodingParams(json=s)))
        print("COMPILED")
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("compiling a 40-deep schema still working after 60 s")
    assert "COMPILED" in proc.stdout, (proc.returncode, proc.stderr[-500:])


def test_rust_only_syntax_regex_is_not_refused():
    """\\p{L} is outlines-core (regex-automata) syntax CPython's parser lacks: the fallback multiplies every
    repeat count in the regex together (50 * 20 * 100 * len), so this ~200-character guide is 'too large'."""
    regex = r"\p{L}{1,50}-[0-9]{1,20}-[a-z]{1,100}"
    assert guide_regex(GuidedDecodingParams(regex=regex))


def test_an_oversized_regex_is_refused_quickly():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        guide_regex(GuidedDecodingParams(regex="(ab){1000}{1000}"))
    assert time.perf_counter() - start < 1.5


def test_single_element_type_list_keeps_integer_bounds():
    guided = GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])
    params = _params(json={"type": ["integer"], "minimum": 5, "maximum": 9})
    assert _walks(guided, params, "7") and not _walks(guided, params, "12")


@pytest.mark.parametrize("regex", [".{0,4000}", '[^"]{0,1000}', r"\w{1,200}", r"\p{L}{0,100}", r"\S{300}"])
def test_a_broad_class_counts_as_many_characters(regex):
    """Review 35: `.{0,4000}` counted 4,000 characters and passed, but each of its states lists nearly the whole
    vocabulary: outlines-core took 59 s and aborted the process at 6 GB (one request could end the server)."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"too large.*`\.`, negated classes count 400"):
        guide_regex(GuidedDecodingParams(regex=regex))
    assert time.perf_counter() - start < 1.5


def test_modest_broad_and_ascii_regexes_still_pass():
    for regex in (".{0,200}", r"\w{1,40}", "[A-Za-z0-9_]{1,5000}", r"[0-9]{3}-\s?[a-z]{1,2000}"):
        assert guide_regex(GuidedDecodingParams(regex=regex))
