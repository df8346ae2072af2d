"""guide_regex's size bound (lmjax/engine/guided_regex.py) is checked only after outlines-core built the whole
regex and after CPython's re parser parsed all of it: nested objects with optional properties (not arrays, so
check_nesting passes) grow the regex ~4x a level. A 1 KB schema costs seconds to minutes of parsing (and GBs)
before the "too large" ValueError (20 levels: minutes); much deeper ones (~28+, estimated) would exhaust
memory inside build_regex_from_schema itself."""
import subprocess
import sys
import textwrap
import time

import pytest

from lmjax import GuidedDecodingParams
from lmjax.engine.guided_regex import guide_regex


def nested_objects(n):
    s = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s, "b": {"type": "integer"}}}
    return s


def test_oversized_schema_is_refused_quickly():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large|nested"):
        guide_regex(GuidedDecodingParams(json=nested_objects(13)))  # an 890-byte schema
    assert time.perf_counter() - start < 1.5, f"refusal took {time.perf_counter() - start:.1f} s"


def test_deep_schema_is_refused_without_building_it():
    """Under a 2 GB address-space limit the refusal must still be a ValueError (the regex is never built)."""
    code = textwrap.dedent("""
        import resource, sys
        def nested_objects(n):
            s = {"type": "integer"}
            for _ in range(n):
                s = {"type": "object", "properties": {"a": s, "b": {"type": "integer"}}}
            return s
        from lmjax import GuidedDecodingParams
        from lmjax.engine.guided_regex import guide_regex
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        try:
            guide_regex(GuidedDecodingParams(json=nested_objects(20)))
        except ValueError as e:
            print("REFUSED", str(e)[:80])
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("guide_regex still working after 30 s")
    assert "REFUSED" in proc.stdout, (proc.returncode, proc.stderr[-500:])


def test_rust_only_syntax_regex_is_not_refused():
    """\\p{L} is outlines-core (regex-automata) syntax CPython's parser lacks: the fallback multiplies every
    repeat count in the regex together (50 * 20 * 100 * len), so this ~200-character guide is 'too large'."""
    regex = r"\p{L}{1,50}-[0-9]{1,20}-[a-z]{1,100}"
    assert guide_regex(GuidedDecodingParams(regex=regex))


def test_single_element_type_list_keeps_integer_bounds():
    import re
    regex = guide_regex(GuidedDecodingParams(json={"type": ["integer"], "minimum": 5, "maximum": 9}))
    assert not re.fullmatch(regex, "12")
