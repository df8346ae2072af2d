"""LMDeploy leaves the token that stopped a reply (EOS or a stop id) out of Response.token_ids, logprobs and
generate_token_len (lmdeploy/serve/async_engine.py: `hit_stop_token`, `token_ids[:output_len - hit_stop_token]`;
with include_stop_str_in_output its last output carries the id), where vLLM keeps it. lmjax's LMDeploy facades
gave vLLM's counts: token_ids ended with EOS and every stopped reply counted one token more (probe 25)."""
import asyncio

import numpy as np
import pytest

from lmjax import GenerationConfig, PytorchEngineConfig, pipeline
from tiny_llama import write_tiny_llama
from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)

EOS = 3


def _forcing(tokens):
    """An LMDeploy logits processor whose request outputs `tokens` (the last repeated)."""
    calls = []

    def force(input_ids, logits):
        logits[:] = -np.inf
        logits[tokens[min(len(calls), len(tokens) - 1)]] = 0.0
        calls.append(1)
        return logits
    return force


def _config(tokens, **kw):
    return GenerationConfig(max_new_tokens=8, logits_processors=[_forcing(tokens)], **kw)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    p = pipeline(write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=EOS),
                 backend_config=PytorchEngineConfig(session_len=64))
    yield p
    p.close()


@pytest.mark.parametrize("kw, want", [({}, [5, 6]), ({"stop_token_ids": [6]}, [5])])
def test_pipeline_leaves_the_stop_token_out(pipe, kw, want):
    r = pipe(["t9 t8"], gen_config=_config([5, 6, EOS], logprobs=2, **kw), do_preprocess=False)[0]
    assert (r.token_ids, r.generate_token_len, r.finish_reason) == (want, len(want), "stop")
    assert len(r.logprobs) == len(want)


def test_include_stop_str_in_output_keeps_the_id_but_not_the_count(pipe):
    r = pipe(["t9 t8"], gen_config=_config([5, 6, EOS], include_stop_str_in_output=True), do_preprocess=False)[0]
    assert (r.token_ids, r.generate_token_len) == ([5, 6, EOS], 2)


def test_stream_infer_and_async_generate_leave_it_out(pipe):
    pieces = list(pipe.stream_infer(["t9 t8"], gen_config=_config([5, 6, EOS]), do_preprocess=False))
    assert [t for p in pieces for t in p.token_ids] == [5, 6] and pieces[-1].generate_token_len == 2

    async def last():
        outs = [o async for o in pipe.generate("t9 t8", 7, _config([5, 6, EOS]), do_preprocess=False)]
        return outs[-1]
    out = asyncio.run(last())
    assert (out.generate_token_len, out.finish_reason) == (2, "stop")


@pytest.mark.parametrize("kind", ["output_logits", "output_last_hidden_state"])
def test_the_stop_tokens_logits_and_hidden_row_go_too(pipe, kind):
    """(review 25: the rows stayed, [3, V] logits for 2 token ids)"""
    for pieces in (False, True):
        cfg = _config([5, 6, EOS], **{kind: "generation"})
        r = list(pipe.stream_infer(["t9 t8"], gen_config=cfg, do_preprocess=False))[-1] if pieces else \
            pipe(["t9 t8"], gen_config=cfg, do_preprocess=False)[0]
        rows = r.logits if kind == "output_logits" else r.last_hidden_state
        assert rows.shape[0] == 2, (pieces, rows.shape)


def test_a_length_cut_reply_keeps_every_token(pipe):
    r = pipe(["t9 t8"], gen_config=GenerationConfig(max_new_tokens=3, logits_processors=[_forcing([5])]),
             do_preprocess=False)[0]
    assert (r.token_ids, r.generate_token_len, r.finish_reason) == ([5, 5, 5], 3, "length")


def test_the_openai_routes_keep_vllms_count(http):
    body = {"model": "tiny", "prompt": "t9", "max_tokens": 5, "temperature": 0, "logit_bias": {str(EOS): 100}}
    got = http.post("/v1/completions", json=body).json()
    assert got["usage"]["completion_tokens"] == 1 and got["choices"][0]["finish_reason"] == "stop", got
