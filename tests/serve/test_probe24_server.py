"""OpenAI server findings of probe 24, on a tiny random Llama (word-level vocabulary t0..t255, t3 ends a
sequence) behind the app in process, with a Jinja chat template that, like Qwen3's, writes more when
enable_thinking is false:
- vLLM's chat_template_kwargs (and a per-request chat_template) reach the template in /v1/chat/completions and
  /tokenize (they were dropped silently: agent stacks turn Qwen3's thinking off this way);
  return_tokens_as_token_ids names logprob tokens "token_id:{id}" as vLLM;
- /v1/completions with echo and max_tokens 0 answers the prompt and its logprobs alone (OpenAI's legacy
  scoring call, vLLM's too): it was a 400;
- a named tool_choice whose "function" is not an object is a 400 (was a plain-text 500, which openai-python
  retries); a body that is not JSON names no field (its `param` was a character offset); max_completion_tokens
  out of range is named as sent."""
import json

import pytest

from conftest import write_tiny_llama
from app_client import app_client

TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and enable_thinking is false %}t7 t7 t7 {% endif %}t5")
USER = [{"role": "user", "content": "t9 t8"}]
PROMPT = [5, 9, 7, 4, 6]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    with app_client(path, 256) as (engine, client):
        yield client


def _chat(http, **extra):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 1,
                                                  "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_kwargs_and_a_requests_own_template_reach_the_prompt(http):
    assert _chat(http)["usage"]["prompt_tokens"] == 3  # "t9 t8 t5"
    assert _chat(http, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"] == 6
    own = "{% for m in messages %}{{ m['content'] }} {% endfor %}t6 t6"
    assert _chat(http, chat_template=own)["usage"]["prompt_tokens"] == 4
    r = http.post("/tokenize", json={"model": "tiny", "messages": USER,
                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["tokens"] == [9, 8, 7, 7, 7, 5], r.text


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http):
    out = _chat(http, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)["choices"][0]
    entry = out["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and int(entry["token"].split(":")[1]) >= 0
    assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_answers_the_scored_prompt_alone(http, stream):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    else:
        choice = r.json()["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        scored = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
        assert choice["logprobs"]["token_logprobs"] == scored["token_logprobs"][:len(PROMPT)]
        assert choice["logprobs"]["token_logprobs"][0] is None and r.json()["usage"]["completion_tokens"] == 0
    assert text.split() == [f"t{i}" for i in PROMPT] and len(tokens) == len(PROMPT)
    assert http.post("/v1/completions", json={**body, "echo": False}).status_code == 400  # max_tokens 0 alone


@pytest.mark.parametrize("function", ["f", None, ["f"]])
def test_a_named_tool_choice_without_a_function_object_is_a_400(http, function):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2, "tools": tools,
                                                 "tool_choice": {"type": "function", "function": function}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "tool_choice" in r.json()["error"]["message"]


def test_errors_name_what_the_client_sent(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert "not valid JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_completion_tokens": 0})
    assert r.status_code == 400 and "max_completion_tokens must be at least 1" in r.json()["error"]["message"], r.text


def test_role_markers_refuse_template_kwargs_naming_them():
    from lmjax import ChatTemplateConfig

    markers = ChatTemplateConfig(model_name="plain", user="U:", eoh="\n", assistant="A:")
    with pytest.raises(ValueError, match="enable_thinking"):
        markers.messages2prompt(USER, None, enable_thinking=False)
