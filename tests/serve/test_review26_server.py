"""Review 26 of the day's server changes:
- a request that gives no max_tokens takes the model's generation_config max_new_tokens, and where prompt +
  max_new_tokens passes the context it runs to the end of the context (vLLM's get_max_tokens: the min of the
  room left and the default), not a 400 naming a max_tokens the client never sent;
- `lmjax.serve(model, backend_config=TurbomindEngineConfig(...))` lowered the configs' new seed=None onto no
  api_server flag and raised; the api_server (LMDeploy's CLI) draws a random engine seed (LMDeploy's server
  draws one per unseeded request) unless --seed N (vLLM's) asks for repeatable runs."""
import json
import os

import pytest

import lmjax
from app_client import app_client
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("m"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"max_new_tokens": 60, "temperature": 0.0}, f)
    return path


def test_default_max_new_tokens_is_cut_to_the_context_not_a_400(model):
    messages = [{"role": "user", "content": "t1 t2 t3 t4 t5 t6 t7 t8"}]
    with app_client(model, session_len=64) as (_, client):
        n_prompt = len(client.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"])
        assert n_prompt + 60 > 64
        resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 64 - n_prompt
        asked = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 60})
        assert asked.status_code == 400 and "max_tokens=60 is too large" in asked.text  # the client's own: vLLM's 400


def test_serve_takes_lmdeploy_backend_configs():
    from lmjax.serve.launch import _engine_options

    for cfg in (lmjax.TurbomindEngineConfig(session_len=64), lmjax.PytorchEngineConfig()):
        assert _engine_options(cfg, None)["seed"] is None
    assert _engine_options(None, None)["seed"] is None
    assert _engine_options(lmjax.EngineConfig(seed=3), None)["seed"] == 3


@pytest.mark.parametrize("argv, seed", [([], None), (["--seed", "7"], 7)])
def test_api_server_engine_seed(monkeypatch, argv, seed):
    import lmjax.api.async_engine as ae
    from lmjax import cli

    seen = {}
    monkeypatch.setattr(ae, "AsyncEngine", lambda model, backend_config=None, **_: seen.update(config=backend_config))
    cli._async_engine(cli.build_parser().parse_args(["serve", "api_server", "m", *argv]))
    assert seen["config"].seed == seed
