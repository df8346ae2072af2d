"""Two findings of the review of session 24's server changes, on a tiny random Llama (word-level vocabulary
t0..t255, t3 ends a sequence) behind the app in process: chat_template_kwargs may set add_generation_prompt /
continue_final_message (vLLM updates the template's arguments with them; lmjax answered a 400 naming its own
encode_chat), and LMDeploy's /v1/chat/interactive keeps answering an "error" finish as LMDeploy does (a line
with finish_reason "error"), not with the OpenAI routes' error body."""
import pytest

from conftest import write_tiny_llama
from app_client import app_client

TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}t5{% endif %}")
USER = [{"role": "user", "content": "t9 t8"}]
SESSION_LEN = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    with app_client(path, SESSION_LEN) as (engine, client):
        yield client, engine


def test_chat_template_kwargs_may_carry_add_generation_prompt(served):
    """vLLM builds the template's arguments as dict(chat_template=..., add_generation_prompt=...,
    continue_final_message=..., tools=..., documents=...) and then .update(chat_template_kwargs): a client's
    chat_template_kwargs {"add_generation_prompt": false} renders without the generation prompt. lmjax passes
    both to encode_chat as keywords (openai_server.chat_prompt): a TypeError, answered as a 400 whose message
    names lmjax's internal function ("encode_chat() got multiple values for keyword argument ...")."""
    http, _ = served
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 1,
                                                 "temperature": 0,
                                                 "chat_template_kwargs": {"add_generation_prompt": False}})
    assert "encode_chat()" not in r.text, r.text
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2  # "t9 t8", no "t5"


def test_lmdeploy_interactive_route_keeps_its_error_finish_reason(served, monkeypatch):
    """The "error" finish reason was made an OpenAI error body for the OpenAI routes (commit d00f682), but
    `_chain` is shared by LMDeploy's /v1/chat/interactive too: it now answers a 400 OpenAI error body where
    LMDeploy (and lmjax before) answers its own {"text", "tokens", ..., "finish_reason": "error"} line."""
    http, engine = served
    original = engine.sampling_params

    def stuck(gen_config=None, template=None, **kw):  # nothing can be sampled: only EOS allowed, EOS banned
        p = original(gen_config, template, **kw)
        p.allowed_token_ids, p.min_tokens = [3], 2
        return p
    monkeypatch.setattr(engine, "sampling_params", stuck)
    r = http.post("/v1/chat/interactive", json={"prompt": "t9 t8", "request_output_len": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] == "error", r.text
