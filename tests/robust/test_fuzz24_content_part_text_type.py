"""A text content part whose "text" is not a string fails with str.join's message, which names no message or
field: "sequence item 0: expected str instance, int found".

text_content (lmjax/loader/tokenizer.py:101) joins p.get("text", "") of every text part without checking it is a
str. The server answers 400 with that bare message (/v1/chat/completions, /tokenize, /v1/embeddings: ChatMessage's
content is list[dict], so pydantic does not look inside the parts); LLM.chat and the LMDeploy facades raise
TypeError with it. Every other malformed message is named ("messages[0].content must be a string, ..."; "messages[0]:
content parts of type ['image_url'] are not supported"). Expected: an error naming messages[0] and the part's
text field (vLLM's pydantic answers "messages.0.content...text: Input should be a valid string")."""

import pytest

from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)


PARTS = [[{"type": "text", "text": 5}], [{"type": "text", "text": None}], [{"type": "text", "text": ["t5"]}]]


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_the_server_names_a_part_whose_text_is_not_a_string(http, route, parts):
    client = http
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    got = client.post(route, json=body)
    assert got.status_code == 400, got.text
    message = got.json()["error"]["message"]
    assert "text" in message and "message" in message and "sequence item" not in message, message


@pytest.mark.parametrize("parts", PARTS)
def test_the_python_facades_name_it(served, parts):
    from lmjax import GenerationConfig

    engine, _ = served
    with pytest.raises((ValueError, TypeError), match=r"messages\[0\]"):
        engine.batch_infer([[{"role": "user", "content": parts}]], gen_config=GenerationConfig(max_new_tokens=2))
