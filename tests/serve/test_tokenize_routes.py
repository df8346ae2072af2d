"""vLLM's POST /tokenize and /detokenize on SmolLM2's real tokenizer and chat template, in process (the
routes read only the tokenizer, the template and the context length)."""
import pytest
from fastapi.testclient import TestClient

from lmjax.config import ChatTemplateConfig
from lmjax.serve.openai_server import create_app

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def client(smollm2_tokenizer):
    engine = type("E", (), {"model_name": "m", "tokenizer": smollm2_tokenizer, "chat_template": ChatTemplateConfig(),
                            "session_len": 2048,
                            "engine": type("L", (), {"model_config": type("C", (), {"vocab_size": 49152})})()})()
    return TestClient(create_app(engine, api_keys=["k"]), headers={"Authorization": "Bearer k"})


def test_tokenize_a_prompt_and_chat_messages(client, smollm2_tokenizer):
    got = client.post("/tokenize", json={"model": "m", "prompt": "Hello world", "return_token_strs": True}).json()
    want = smollm2_tokenizer("Hello world")["input_ids"]
    assert got == {"count": len(want), "max_model_len": 2048, "tokens": want,
                   "token_strs": smollm2_tokenizer.convert_ids_to_tokens(want)}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    rendered = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
    assert chat["tokens"] == rendered and chat["token_strs"] is None  # as /v1/chat/completions renders it
    plain = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert plain["count"] < chat["count"]
    assert client.post("/detokenize", json={"tokens": want}).json() == {"prompt": "Hello world"}


@pytest.mark.parametrize("path, body, status, named", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "other"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "[49152] are outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    # vLLM's TokenizeChatRequest checks the two switches as chat completions do (lmjax rendered the prompt)
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "Cannot set both"),
])
def test_bad_tokenize_requests(client, path, body, status, named):
    resp = client.post(path, json=body)
    assert resp.status_code == status and named in resp.json()["error"]["message"], resp.text
    assert TestClient(client.app).post(path, json={"prompt": "a", "tokens": [1]}).status_code == 401
