"""The checkpoint's generation_config.json max_new_tokens on the OpenAI routes, as vLLM's get_max_tokens: the
limit of a request that gives no max_tokens (with `--generation-config auto`, the default), and with
`--generation-config DIR` also the cap of a request's own max_tokens. lmjax's server defaulted only
temperature / top_p / top_k / min_p / repetition_penalty, so a chat request without max_tokens ran to the end of
the context whatever the model's authors set (probe 26; README: "the server's values for fields a request
leaves out")."""
import json
import os

import pytest

from app_client import app_client
from tiny_llama import write_tiny_llama


def _model(path, max_new_tokens: int) -> str:
    path = write_tiny_llama(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"max_new_tokens": max_new_tokens, "temperature": 0.0}, f)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("m"), 3)


def _chat(client, **fields) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "t1 t2"}], "ignore_eos": True, **fields}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"]


def _completion(client, **fields) -> int:
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "t1 t2", "ignore_eos": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["completion_tokens"]


def test_the_models_max_new_tokens_limits_requests_without_max_tokens(model):
    with app_client(model, session_len=64) as (_, client):
        assert _chat(client) == 3
        assert _chat(client, max_tokens=None) == 3
        assert _chat(client, max_tokens=5) == 5  # a request's own limit stands ("auto")
        assert _chat(client, max_completion_tokens=6) == 6
        assert _completion(client, max_tokens=None) == 3
        assert _completion(client) == 16  # OpenAI's (and vLLM's) default for completions is a given 16
        assert _completion(client, max_tokens=7) == 7


def test_generation_config_dir_caps_every_request(model):
    from lmjax.loader.generation_config import chosen_sampling_defaults

    with app_client(model, session_len=64, sampling_defaults=chosen_sampling_defaults(model, {})) as (_, client):
        assert _chat(client) == 3
        assert _chat(client, max_tokens=5) == 3
        assert _completion(client, max_tokens=7) == 3
    with app_client(model, session_len=64, sampling_defaults={}) as (_, client):  # --generation-config vllm
        assert _chat(client) == 64 - len(client.post("/tokenize", json={
            "model": "tiny", "messages": [{"role": "user", "content": "t1 t2"}]}).json()["tokens"])


def test_a_default_past_the_context_is_cut_to_the_room_left_not_a_400(tmp_path):
    """(Review 26.) vLLM's get_max_tokens takes the min of the room left and the model's default; only a
    max_tokens the client sent itself is refused."""
    messages = [{"role": "user", "content": "t1 t2 t3 t4 t5 t6 t7 t8"}]
    with app_client(_model(tmp_path, 60), session_len=64) as (_, client):
        n_prompt = len(client.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"])
        assert n_prompt + 60 > 64
        assert _chat(client, messages=messages) == 64 - n_prompt
        asked = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 60})
        assert asked.status_code == 400 and "max_tokens=60 is too large" in asked.text
