"""vLLM's OpenAI server says which stop ended a choice: `stop_reason`, the matched stop string or stop token id
(None for EOS and length), on every choice of /v1/completions and /v1/chat/completions, streamed chunks included
(vLLM's CompletionResponseChoice / ChatCompletionResponseChoice and their stream variants). The engine knew it;
the server left the field out (probe 25)."""
import json

import pytest

from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)

FORCED = {"model": "tiny", "temperature": 0, "max_tokens": 20, "logit_bias": {"5": 100}}  # "t5 t5 t5 ..."


@pytest.mark.parametrize("stop, text, reason", [({"stop": ["t5 t5"]}, " ", "t5 t5"),
                                                ({"max_tokens": 1}, " t5", None)])
def test_completion_and_chat_choices_carry_stop_reason(http, stop, text, reason):
    choice = http.post("/v1/completions", json={**FORCED, **stop, "prompt": "t9"}).json()["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == (text, reason), choice
    chat = http.post("/v1/chat/completions", json={**FORCED, **stop, "messages": [{"role": "user", "content": "t9"}]})
    assert chat.json()["choices"][0]["stop_reason"] == reason, chat.json()


def test_a_stop_token_id_is_the_reason(http):
    body = {"model": "tiny", "temperature": 0, "max_tokens": 20, "prompt": "t9", "logit_bias": {"7": 100},
            "stop_token_ids": [7]}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 7), choice


@pytest.mark.parametrize("route, extra", [("/v1/completions", {"prompt": "t9"}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t9"}]})])
def test_the_streamed_final_chunk_carries_stop_reason(http, route, extra):
    with http.stream("POST", route, json={**FORCED, "stop": ["t5 t5"], "stream": True, **extra}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["stop_reason"] for f in finals] == ["t5 t5"], chunks


def test_an_echo_only_completion_has_no_stop_reason(http):
    """echo with max_tokens 0 answers the prompt alone: "length" and no stop_reason, whatever the engine's one
    token was stopped by (review 25)."""
    body = {"model": "tiny", "prompt": "t9", "echo": True, "max_tokens": 0, "temperature": 0,
            "logit_bias": {"7": 100}, "stop_token_ids": [7]}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None), choice
