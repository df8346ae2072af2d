"""An infinite integer bound in a guided JSON schema is an OverflowError, not the ValueError (400) that names
the schema.

_bounded_integers (lmjax/engine/guided_regex.py:148-154) does math.ceil / math.floor on minimum / maximum; an
infinite one raises OverflowError ("cannot convert float infinity to integer"), which GuidedDecoding.index
(lmjax/engine/guided.py:157) does not catch (it maps ValueError, TypeError and RuntimeError), and neither does the
server's api_errors. Python's JSON parser, which the server uses, reads `Infinity`, so
`"guided_json": {"type": "integer", "minimum": Infinity}` (also in response_format's schema or a forced tool's
parameters) answers a bare text/plain 500, and LLM.generate raises OverflowError naming nothing. (NaN already
gives a ValueError, naming the schema, by luck: math.ceil(nan) raises ValueError.)"""

import pytest

from lmjax import GuidedDecodingParams, SamplingParams  # noqa: E402
from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)

SCHEMA_TEXT = '{"type":"integer","minimum":Infinity}'


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", '{"model":"tiny","prompt":[5],"max_tokens":2,"guided_json":%s}' % SCHEMA_TEXT),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"t5"}],"max_tokens":2,'
                             '"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":%s}}}'
     % SCHEMA_TEXT),
])
def test_an_infinite_bound_is_a_400_naming_the_schema(http, route, body):
    got = http.post(route, content=body, headers={"content-type": "application/json"})
    assert got.status_code == 400, f"{got.status_code} {got.headers.get('content-type')}: {got.text[:200]}"
    assert "minimum" in got.json()["error"]["message"], got.text


@pytest.mark.parametrize("bound", [{"minimum": float("inf")}, {"maximum": float("-inf")},
                                   {"exclusiveMaximum": float("inf")}])
def test_llm_names_an_infinite_bound(tiny, bound):
    from lmjax import LLM

    llm = LLM(tiny, max_model_len=128, block_size=16)
    params = SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(json={"type": "integer", **bound}))
    with pytest.raises(ValueError, match=next(iter(bound))):
        llm.generate([[5, 9]], params, use_tqdm=False)
