"""A small guided-decoding schema or regex can make the guide compile take unbounded time and memory.

Bodies of a few dozen bytes (`{"type": "string", "minLength": 1000000000}`, an array nested 40 deep, an
integer with maximum 1e300, a regex repeat `(t1){1000}{1000}`) pass every check and go to outlines-core, whose
regex / automaton grows with the number (or exponentially with the nesting: outlines writes an array's item
schema twice per level; JSON schemas are llguidance's since session 28, which builds lazily). Measured on the 256-token tiny vocabulary: minLength=1e9 reaches 20 GB in 60 s,
nesting 50 was OOM-killed at 23.8 GB after 37 s, maximum=1e300 is still compiling after 60 s at 2.7 GB. The
server compiles in a worker thread, so the event loop keeps running until the process runs out of memory and
takes every request with it. Expected: a ValueError (400) naming the value, before any large allocation.

Each case runs in a child process limited to 8 GiB of address space (a GPU host's torch import alone
reserves more than 3) and 20 s, so the blow-up cannot hurt the
host. Before the size checks (probe 24) every case ended by timeout or by an allocation failure."""
import os
import subprocess
import sys
import textwrap

import pytest

from tiny_server_fixtures import tiny  # noqa: F401 (pytest fixtures)


CHILD = textwrap.dedent("""
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    os.environ["JAX_PLATFORMS"] = "cpu"
    from lmjax import GuidedDecodingParams, SamplingParams
    from lmjax.engine.guided import GuidedDecoding
    from lmjax.loader.tokenizer import load_tokenizer
    kind, spec = sys.argv[2], json.loads(sys.argv[3])
    guided = GuidedDecoding(load_tokenizer(sys.argv[1]), 256, [3])
    try:
        guided.check(SamplingParams(guided_decoding=GuidedDecodingParams(**{kind: spec})))
        print("RESULT compiled")
    except ValueError as e:
        print("RESULT ValueError", str(e)[:300])
""")


def nested_arrays(depth):
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kind, spec, named", [
    ("json", {"type": "string", "minLength": 10**9}, ("minLength",)),
    ("json", {"type": "integer", "minimum": 0, "maximum": 1e300}, ("maximum",)),
    # llguidance (JSON's backend since session 28) compiles deep nesting lazily: bounded, so no refusal needed
    # (this vocabulary spells no "[", which is the refusal it gets)
    ("json", nested_arrays(40), ("no token that can begin",)),
    ("regex", "(t1){1000}{1000}", ("1000",)),
])
def test_a_huge_guide_is_refused_quickly_not_compiled_without_bound(tiny, kind, spec, named):
    import json

    try:
        done = subprocess.run([sys.executable, "-c", CHILD, tiny, kind, json.dumps(spec)], capture_output=True,
                              text=True, timeout=20, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling guided {kind}={json.dumps(spec)[:80]} ran past 20 s (no bound on its size)")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, f"the compile died (rc={done.returncode}, 8 GiB cap): {done.stderr[-400:]}"
    assert lines[0].startswith("RESULT ValueError") and any(n in lines[0] for n in named), lines[0]
