"""Review 34 of the OpenAI server, on a tiny random Llama behind the app in process: a word-level vocabulary
t0..t255 whose tokenizer adds BOS (t1) to plain text, as Llama's does, and a Jinja chat template that writes
t6 for vLLM's `documents` and t5 for the generation prompt.
- a request failing on its first token was a 200 stream holding only an error frame (a 400 when not
  streamed); a stream failing later ended without vLLM's `data: [DONE]` and with another `code`;
- vLLM's add_special_tokens, documents, body request_id and priority were ignored; suffix "" was taken;
  continue_final_message needed an assistant message last (vLLM refuses only add_generation_prompt=true too);
- vLLM's /ping and /load were missing, a non-JSON Content-Type got a message about a dictionary;
- --max-tokens-overflow cut (LMDeploy's rule, lmjax.serve()'s default) cuts max_tokens to the room left."""
import asyncio
import contextlib
import json
import warnings

import pytest

from app_client import app_client
from tiny_llama import write_tiny_llama

TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if documents %}t6 {% endif %}"
            "{% if add_generation_prompt %}t5{% endif %}")
USER = [{"role": "user", "content": "t9 t8"}]  # renders "t9 t8 t5": 3 tokens, no BOS (Jinja: vLLM's rule)
SESSION_LEN = 64


def _bos_tokenizer(vocab_size: int, out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", bos_token="t1", unk_token="t2")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer=_bos_tokenizer, eos_token_id=3)


@pytest.fixture(scope="module")
def http(tiny):
    with app_client(tiny, SESSION_LEN) as (_, client):
        yield client


def _chat(http, status=200, **extra):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 1,
                                                  "temperature": 0, **extra})
    assert r.status_code == status, r.text
    return r.json()


def _completion(http, status=200, **extra):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "t9 t8", "max_tokens": 1, "temperature": 0,
                                             **extra})
    assert r.status_code == status, r.text
    return r.json()


# 1. errors of a streamed response

STUCK = {"allowed_token_ids": [5], "bad_words": ["t5"]}  # nothing can be sampled: fails on the first token


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_failing_on_its_first_token_is_the_same_400_streamed_or_not(http, route):
    body = {"model": "tiny", "max_tokens": 4, **STUCK,
            **({"prompt": "t9 t8"} if route == "/v1/completions" else {"messages": USER})}
    plain = http.post(route, json=body)
    streamed = http.post(route, json={**body, "stream": True})
    assert plain.status_code == streamed.status_code == 400, streamed.text
    assert streamed.json() == plain.json()


def test_a_stream_failing_later_ends_with_done_and_the_non_streamed_code(http, monkeypatch):
    from lmjax.serve import routes_generate
    from lmjax.serve.errors import APIError

    real = routes_generate._chain

    async def failing(first, rest, openai=True):  # the request fails after its first piece went out
        async with contextlib.aclosing(real(first, rest, openai)) as items:
            async for item in items:
                yield item
                raise APIError(400, "the request failed: simulated")
    monkeypatch.setattr(routes_generate, "_chain", failing)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "t9 t8", "max_tokens": 3, "stream": True})
    frames = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and frames[-1] == "[DONE]", r.text
    error = json.loads(frames[-2])["error"]
    assert error["message"] == "the request failed: simulated" and error["code"] == 400  # as the 400's body


# 2.-5. vLLM's request fields

def test_add_special_tokens(http):
    assert _completion(http)["usage"]["prompt_tokens"] == 3  # t1 t9 t8
    assert _completion(http, add_special_tokens=False)["usage"]["prompt_tokens"] == 2
    assert _chat(http)["usage"]["prompt_tokens"] == 3  # t9 t8 t5: the template's text as it is
    assert _chat(http, add_special_tokens=True)["usage"]["prompt_tokens"] == 4


def test_documents_reach_the_chat_template(http):
    assert _chat(http, documents=[{"title": "a", "text": "b"}])["usage"]["prompt_tokens"] == 4  # + t6
    r = http.post("/tokenize", json={"messages": USER, "documents": [{"text": "b"}]})
    assert r.status_code == 200 and r.json()["tokens"] == [9, 8, 6, 5], r.text


def test_the_body_request_id_names_the_response_unless_the_header_does(http):
    assert _chat(http, request_id="abc")["id"] == "chatcmpl-abc"
    assert _completion(http, request_id="abc")["id"] == "cmpl-abc"
    r = http.post("/v1/chat/completions", headers={"X-Request-Id": "hdr"},
                  json={"model": "tiny", "messages": USER, "max_tokens": 1, "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-hdr"


def test_continue_final_message_needs_only_add_generation_prompt_false(http):
    prompt = _chat(http, add_generation_prompt=False, continue_final_message=True)["usage"]["prompt_tokens"]
    assert prompt == 2  # "t9 t8" left open, though a user wrote it
    body = _chat(http, 400, continue_final_message=True)
    assert body["error"]["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    r = http.post("/v1/embeddings", json={"messages": USER, "continue_final_message": True})
    assert r.status_code == 200, r.text


# 6. the small surface

def test_ping_and_load(http):
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}


def test_load_counts_generation_requests_in_flight():
    from starlette.datastructures import State

    from lmjax.serve.http_extras import _CountLoad

    state, seen = State(), []
    state.server_load = 0

    async def app(scope, receive, send):
        seen.append(state.server_load)
    counted = _CountLoad(app, state)
    asyncio.run(counted({"type": "http", "path": "/v1/completions"}, None, None))
    asyncio.run(counted({"type": "http", "path": "/health"}, None, None))
    assert seen == [1, 0] and state.server_load == 0


def test_priority_suffix_and_content_type_are_refused_as_vllm(http):
    assert _chat(http, priority=0)["choices"]
    assert _chat(http, 400, priority=5)["error"]["message"] == "Got priority 5 but Priority scheduling is not enabled."
    assert "suffix" in _completion(http, 400, suffix="")["error"]["message"]
    r = http.post("/v1/completions", headers={"Content-Type": "text/plain"},
                  content=json.dumps({"model": "tiny", "prompt": "t9", "max_tokens": 1}))
    assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"], r.text


def test_model_cards_have_parent_and_permission(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["parent"] is None and card["permission"][0]["object"] == "model_permission"


# 7. LMDeploy's max_tokens rule

def test_max_tokens_overflow_cut(tiny, http):
    assert _completion(http, 400, max_tokens=512)["error"]["message"].startswith("max_tokens=512 is too large")
    with app_client(tiny, SESSION_LEN, max_tokens_overflow="cut") as (_, cut):
        body = _completion(cut, max_tokens=512, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == SESSION_LEN - 3
        assert body["choices"][0]["finish_reason"] == "length"
        full = _completion(cut, prompt=" ".join(["t9"] * SESSION_LEN), max_tokens=512, n=2)  # no room at all
        assert [(c["text"], c["finish_reason"]) for c in full["choices"]] == [("", "length")] * 2
        assert full["usage"]["completion_tokens"] == 0 and full["usage"]["prompt_tokens"] == SESSION_LEN + 1


def test_lmdeploy_launcher_cuts_by_default(monkeypatch):
    from lmjax.serve import launch

    class Started(Exception):
        pass

    def record(argv, url):
        raise Started(argv)
    monkeypatch.setattr(launch, "ServerProcess", record)
    monkeypatch.setattr(launch, "_check_port_free", lambda *a: None)
    for kwargs, want in (({}, "cut"), ({"max_tokens_overflow": "error"}, "error")):
        with pytest.raises(Started) as started:
            launch.serve("some/model", **kwargs)
        argv = started.value.args[0]
        assert argv[argv.index("--max-tokens-overflow") + 1] == want


# 8. vLLM's chat echo

PREFILL = [*USER, {"role": "assistant", "content": "t7 t7"}]


def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(http):
    reply = _chat(http, messages=PREFILL, add_generation_prompt=False, continue_final_message=True, echo=True,
                  max_tokens=2, ignore_eos=True)["choices"][0]["message"]["content"]
    assert reply.startswith("t7 t7") and len(reply.split()) == 4, reply
    plain = _chat(http, echo=True, max_tokens=2, ignore_eos=True)["choices"][0]["message"]["content"]
    assert len(plain.split()) == 2  # a user's message last: the assistant's reply echoes nothing
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": PREFILL, "max_tokens": 2, "echo": True,
                                                 "add_generation_prompt": False, "stream": True, "ignore_eos": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "t7 t7"}, r.text
    assert "role" not in chunks[1]["choices"][0]["delta"]


def test_without_a_generation_prompt_the_reply_takes_the_last_messages_role(http):
    """vLLM's get_chat_request_role: the reply continues the last message, so it carries that message's role
    (and echoes it), streamed or not; with a generation prompt it is the assistant's."""
    body = {"messages": USER, "add_generation_prompt": False, "echo": True, "max_tokens": 2, "ignore_eos": True}
    message = _chat(http, **body)["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("t9 t8"), message
    r = http.post("/v1/chat/completions", json={"model": "tiny", **body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "user", "content": "t9 t8"}, r.text
    assert _chat(http, max_tokens=2)["choices"][0]["message"]["role"] == "assistant"


def test_the_openapi_page_lists_every_route_once(http):
    """/ping's GET and POST had one operation id (FastAPI warned "Duplicate Operation ID" building /docs)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = http.get("/openapi.json").json()
    assert not [w for w in caught if "Duplicate Operation ID" in str(w.message)]
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"get", "post"} <= set(spec["paths"]["/ping"])
