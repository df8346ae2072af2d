"""Robustness of one tiny random Llama (word-level vocabulary t0..t255, t3 ends a sequence; no chat template:
LMDeploy's base template renders messages) behind an AsyncEngine and the OpenAI server in-process (server
exceptions come back as responses, as a client would see them):
- sampling values that pass SamplingParams' checks but broke the engine: ints the host packs into int32 step
  inputs (top_k, stop_token_ids under min_tokens, bad_token_ids), a temperature past float32, an n no engine
  can run: each a clear error naming the value (a 400 on the server) or served correctly, never an
  engine-step failure that also fails the other requests in flight;
- the server's error answers: an engine failure reaches a non-streaming client as OpenAI's error body, a
  malformed /v1/chat/interactive message list or an empty /v1/encode input is a 400 naming it; the server
  serves the next request either way;
- the Python facades' per-prompt arguments: a list holding something other than the params object it should
  is a TypeError naming the argument, and a chat message without a role a ValueError naming it."""
import asyncio

import pytest
from fastapi.testclient import TestClient

from conftest import write_tiny_llama
from lmjax import GenerationConfig, SamplingParams

INT32_OVER = 2**31  # one past int32: what build_sampling_metadata packs these fields into
USER = [{"role": "user", "content": "t5 t6"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    config = TurbomindEngineConfig(session_len=256, cache_block_seq_len=16)
    engine = AsyncEngine(path, model_name="tiny", backend_config=config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(engine):
    from lmjax.serve.openai_server import create_app

    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield client


def still_serves(http) -> None:
    """A plain request right after a bad one is answered."""
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 9], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": [5, 9], "max_tokens": 3, "temperature": 1.0, "top_k": INT32_OVER}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 3, "temperature": 1.0,
                              "top_k": 2**63 - 1}, "top_k"),
    ("/v1/completions", {"prompt": [5, 9], "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [INT32_OVER]},
     "stop_token_ids"),
    ("/v1/chat/interactive", {"prompt": "t5", "request_output_len": 3, "top_k": INT32_OVER}, "top_k"),
])
def test_a_value_past_int32_is_named_or_served_not_a_500(http, route, body, field):
    """Today: the step's OverflowError ("Python integer 2147483648 out of bounds for int32") fails the engine
    step, and the route answers a bare 500."""
    got = http.post(route, json={"model": "tiny", **body})
    assert got.status_code in (200, 400), f"{got.status_code}: {got.text[:300]}"
    if got.status_code == 400:
        assert field in got.json()["error"]["message"], got.text
    still_serves(http)


def test_a_top_k_past_int32_does_not_fail_a_running_neighbour(engine):
    """Today: the bad request's step fails and EngineThread._step fails every live request with it."""
    good = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    alone = engine.batch_infer("t5 t9 t12", gen_config=good, do_preprocess=False).token_ids

    async def main():
        tokens, started = [], asyncio.Event()

        async def neighbour():
            async for out in engine.generate("t5 t9 t12", 7001, good, do_preprocess=False):
                tokens.extend(out.token_ids)
                started.set()
        task = asyncio.create_task(neighbour())
        await started.wait()
        bad, bad_error, neighbour_error = SamplingParams(temperature=1.0, top_k=INT32_OVER, max_tokens=3), None, None
        try:
            async for _ in engine.generate("t5", 7002, bad, do_preprocess=False):
                pass
        except Exception as e:  # noqa: BLE001
            bad_error = e
        try:
            await task
        except Exception as e:  # noqa: BLE001
            neighbour_error = e
        return tokens, neighbour_error, bad_error
    tokens, neighbour_error, bad_error = asyncio.run(main())
    assert neighbour_error is None, f"the good request failed because of its neighbour: {neighbour_error!r}"
    assert tokens == alone
    # refusing the bad one is fine, if the error names the field
    assert bad_error is None or (isinstance(bad_error, ValueError) and "top_k" in str(bad_error)), repr(bad_error)


def test_a_bad_token_id_past_int32_is_named(engine):
    """Python facade: today a RuntimeError "engine step failed: Python integer 2147483648 out of bounds for
    int32", which names neither the field nor the value."""
    try:
        engine.batch_infer("t5", gen_config=SamplingParams(bad_token_ids=[INT32_OVER], max_tokens=2),
                           do_preprocess=False)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, ValueError) and "bad_token_ids" in str(e), repr(e)


@pytest.mark.parametrize("constraint, allowed", [
    ({"bad_words": ["t7"]}, lambda tok: tok != "t7"),
    ({"allowed_token_ids": [7, 8]}, lambda tok: tok in ("t7", "t8")),
])
def test_a_temperature_past_float32_keeps_bans_or_is_refused(http, constraint, allowed):
    """temperature=1e39 is a finite float the checks accept, but float32 makes it inf: banned logits become
    -inf/inf = NaN and the row samples garbage. Today bad_words=["t7"] gives " t7 t7 t7 t7 t7" and
    allowed_token_ids=[7, 8] gives EOS (t0), outside the allowed set."""
    got = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 9], "max_tokens": 5, "temperature": 1e39,
                                             "ignore_eos": True, "skip_special_tokens": False, **constraint})
    if got.status_code == 400:
        assert "temperature" in got.json()["error"]["message"], got.text
        return
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    tokens = choice["text"].split()
    assert len(tokens) == 5 and all(allowed(t) for t in tokens), choice


def test_an_n_no_engine_can_run_is_refused_before_any_work(engine):
    """Today validate_request accepts n=10**9 and add_request then loops creating 10**9 completions on the
    engine thread: the server hangs every request (POST /v1/completions with n=1000000000 never answers)."""
    with pytest.raises(ValueError, match=r"\bn\b.*1000000000|1000000000.*\bn\b"):
        engine.engine.validate_request([5, 9], SamplingParams(n=10**9, max_tokens=2))


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "tiny", "prompt": [5, 9], "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 3}),
    ("/v1/chat/interactive", {"prompt": "t5", "request_output_len": 3}),
])
def test_an_engine_step_failure_is_an_openai_error_body(http, engine, monkeypatch, route, body):
    """Today: EngineThread hands the request a RuntimeError("engine step failed: ..."), which start() /
    first_and_rest / _consume do not catch (only ValueError, TypeError): Starlette's bare text/plain
    "Internal Server Error", not the {"error": {...}} body the module docstring promises."""
    inner, real_step = engine.engine, engine.engine.step
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")
        return real_step()
    monkeypatch.setattr(inner, "step", failing_once)
    got = http.post(route, json=body)
    assert got.status_code >= 500, got.text
    assert got.headers["content-type"].startswith("application/json"), got.text[:200]
    assert "simulated device failure" in got.json()["error"]["message"], got.text
    monkeypatch.undo()
    still_serves(http)


@pytest.mark.parametrize("prompt", [
    [{"content": "t5"}],  # no role
    [{}],
])
def test_an_interactive_message_without_a_role_is_a_400_naming_it(http, prompt):
    """Today: KeyError('role') in ChatTemplateConfig._from_markers -> a bare 500 (render_chat, the path of
    templated tokenizers and of /v1/chat/completions, names it: "messages[0] must be a dict with a 'role'
    string")."""
    got = http.post("/v1/chat/interactive", json={"prompt": prompt, "request_output_len": 2})
    assert got.status_code == 400, f"{got.status_code}: {got.text[:200]}"
    assert "role" in got.json()["error"]["message"], got.text
    still_serves(http)


def test_an_empty_encode_input_is_a_400(http):
    """LMDeploy's /v1/encode with input=[]: before, a 200 of empty lists (nothing was asked)."""
    got = http.post("/v1/encode", json={"input": []})
    assert got.status_code == 400, got.text
    assert "input" in got.json()["error"]["message"], got.text
    assert http.post("/v1/encode", json={"input": ["t5"]}).json()["length"] == [1]


def test_a_per_prompt_gen_config_of_the_wrong_type_is_named(engine):
    """Today: AttributeError: 'dict' object has no attribute 'to_sampling_params'."""
    with pytest.raises((TypeError, ValueError), match="gen_config"):
        engine.batch_infer(["t5", "t6"], gen_config=[GenerationConfig(max_new_tokens=2), {"max_new_tokens": 2}])


def test_a_per_prompt_sampling_params_of_the_wrong_type_is_named(engine):
    """LLM.generate's per-prompt list (lmjax.api.batch.per_prompt): today AttributeError: 'dict' object has
    no attribute 'truncate_prompt_tokens' from LLMEngine.validate_request."""
    from lmjax.api.batch import per_prompt, submit_all

    with pytest.raises((TypeError, ValueError), match="sampling_params"):
        params = per_prompt([SamplingParams(max_tokens=2), {"max_tokens": 2}], 2, "sampling_params")
        submit_all(engine.engine, [(None, [5]), (None, [6])], params)


def test_a_chat_message_without_a_role_is_named(engine):
    """Today: KeyError: 'role' (ChatTemplateConfig._from_markers)."""
    with pytest.raises(ValueError, match="role"):
        engine.batch_infer([{"content": "t5"}], gen_config=GenerationConfig(max_new_tokens=2))
    assert engine.batch_infer("t5", gen_config=GenerationConfig(max_new_tokens=2)).finish_reason == "length"


STUCK = {"max_tokens": 4, "temperature": 0, "allowed_token_ids": [3], "min_tokens": 2}  # only eos, eos banned


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": [[5, 9], [7, 8]], **STUCK}),
    ("/v1/chat/completions", {"messages": USER, **STUCK}),
])
def test_a_request_ending_with_error_is_an_error_body_naming_why(http, route, body):
    """A completion that ends with "error" (here: nothing left to sample) answers the request with OpenAI's
    error body carrying the engine's reason, as vLLM answers its "error" finish reason; before, a 200 whose
    choice said finish_reason "error" and nothing else."""
    r = http.post(route, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert "nothing could be sampled for output token 0" in r.json()["error"]["message"]
    still_serves(http)


def test_a_streamed_request_ending_with_error_on_its_first_token_is_the_error_body(http):
    """Streaming: the first output is awaited before the response starts, so a request that fails there gets
    the 400 an unstreamed one gets (a failure later in the stream is its last event, then [DONE]:
    tests/serve/test_review34_server.py), with the engine's reason."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "stream": True, **STUCK})
    assert r.status_code == 400 and "nothing could be sampled" in r.json()["error"]["message"], r.text
    still_serves(http)
