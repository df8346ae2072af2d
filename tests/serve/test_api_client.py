"""What needs no model: APIClient against a server that is not there, and the model names a server
answers to (an app over a stand-in engine)."""
import socket
import types

import httpx
import pytest

from lmjax.serve.client import APIClient, APIConnectionError


def _closed_port() -> int:
    with socket.socket() as s:  # bound then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("call", [
    lambda api: api.available_models,
    lambda api: next(api.chat_completions_v1("m", "hi")),
    lambda api: next(api.chat_completions_v1("m", "hi", stream=True)),
    lambda api: api.encode("hi"),
    lambda api: api.end_session(1),
])
def test_unreachable_server_is_a_builtin_connection_error(call):
    """LMDeploy's client raises requests' ConnectionError (an OSError): `except ConnectionError` and
    `except OSError` catch ours too, with the httpx error as the cause."""
    api = APIClient(f"http://127.0.0.1:{_closed_port()}", timeout=5)
    with pytest.raises(ConnectionError) as info:
        call(api)
    assert isinstance(info.value, APIConnectionError) and isinstance(info.value, OSError)
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert "cannot reach the server" in str(info.value)


def test_client_methods_lmdeploy_code_calls_exist():
    for name in ("encode", "chat", "end_session", "chat_interactive_v1", "chat_completions_v1", "completions_v1"):
        assert callable(getattr(APIClient, name))


def test_a_hugging_face_alias_answers_by_its_short_name_too():
    from fastapi.testclient import TestClient

    from lmjax.serve.openai_server import accepted_names, create_app

    names = accepted_names("SmolLM2-135M-Instruct.Q4_1", ("HuggingFaceTB/SmolLM2-135M-Instruct",))
    assert names == {"SmolLM2-135M-Instruct.Q4_1", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"}
    for path in ("./models/x", "/abs/models/x", "~/x/y", "a/b/c"):  # paths keep only their own spelling
        assert accepted_names("x", (path,)) == {"x", path}
    engine = types.SimpleNamespace(model_name="SmolLM2-135M-Instruct.Q4_1", session_len=2048, id2step={},
                                   tokenizer=None)
    client = TestClient(create_app(engine, model_aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",)))
    for model in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1"):
        assert client.get(f"/v1/models/{model}").status_code == 200, model
    assert client.get("/v1/models/smollm2-135m").status_code == 404
