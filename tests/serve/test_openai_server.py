"""`lmjax serve api_server` as a real process on 127.0.0.1 (a free port) with SmolLM2, driven by the
official `openai` client, raw httpx and lmjax's APIClient. Offline references come from `LLM.generate`
in this process (greedy, float32 on both sides). One server for the whole module; max_tokens stays small."""
import asyncio
import re
import time

import httpx
import pytest

import openai  # noqa: E402
from server_process import api_server

KEY = "sk-test-key"
SESSION_LEN = 2048
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the tallest mountain in the world?"}]


@pytest.fixture(scope="module")
def server(smollm2_pruned):
    with api_server(smollm2_pruned, "--session-len", str(SESSION_LEN), "--dtype", "float32", "--api-keys", KEY,
                    "--log-level", "WARNING") as url:
        yield url


@pytest.fixture(scope="module")
def model_id(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY).models.list().data[0].id


@pytest.fixture(scope="module")
def llm(smollm2_pruned):
    from lmjax import LLM

    return LLM(smollm2_pruned, max_model_len=SESSION_LEN, dtype="float32")


def _greedy(max_tokens=12):
    from lmjax import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)


def _metrics(url) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_health_models_and_binding(server, model_id):
    assert server.startswith("http://127.0.0.1:")
    assert httpx.get(f"{server}/health").status_code == 200
    assert model_id.startswith("SmolLM2")
    m = _metrics(server)
    assert m["lmjax_kv_cache_free_blocks"] == m["lmjax_kv_cache_total_blocks"] > 0


def test_openai_client_matches_offline_generate(server, model_id, llm):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    want = llm.generate(PROMPTS[:2], _greedy(), use_tqdm=False)
    for prompt, ref in zip(PROMPTS[:2], want):
        got = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
        stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref.outputs[0].text
    ref = llm.chat(CHAT, _greedy(), use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == ref and got.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == 12


def test_sampling_fields_n_seed_logprobs_stop(server, model_id, llm):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    kw = dict(model=model_id, messages=CHAT, max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2)
    a = client.chat.completions.create(**kw, extra_body={"top_k": 20})
    b = client.chat.completions.create(**kw, extra_body={"top_k": 20})
    assert len(a.choices) == 2 and [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    got = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    joined = b"".join(bytes(t.bytes) for t in content)  # a token's own bytes: they rejoin split characters
    text = got.choices[0].message.content.encode()
    assert joined.startswith(text) and len(joined) - len(text) < 4
    full = llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[1]  # a word the greedy text contains
    got = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_each_get_their_text(server, model_id, llm):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    want = [r.outputs[0].text for r in llm.generate(prompts, _greedy(6), use_tqdm=False)]

    async def one(client, prompt):
        stream = await client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=600)
        return await asyncio.gather(*[one(client, p) for p in prompts])
    assert asyncio.run(main()) == want


def test_disconnect_mid_stream_frees_blocks(server, model_id):
    idle = _metrics(server)
    body = {"model": model_id, "prompt": PROMPTS[2], "max_tokens": 1000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert _metrics(server)["lmjax_kv_cache_free_blocks"] < idle["lmjax_kv_cache_free_blocks"]
    aborted = 'lmjax_request_finished_total{finished_reason="abort"}'
    deadline = time.time() + 60
    while time.time() < deadline:
        now = _metrics(server)
        if now["lmjax_kv_cache_free_blocks"] == idle["lmjax_kv_cache_free_blocks"]:
            break
        time.sleep(0.2)
    assert now["lmjax_kv_cache_free_blocks"] == idle["lmjax_kv_cache_free_blocks"]
    assert now.get(aborted, 0) == idle.get(aborted, 0) + 1  # aborted, not run to its 1000 tokens
    assert now["lmjax_generation_tokens_total"] - idle["lmjax_generation_tokens_total"] < 1000


def test_non_streaming_client_that_gives_up_frees_blocks(server, model_id):
    idle = _metrics(server)
    body = {"model": model_id, "prompt": PROMPTS[1], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
    aborted = 'lmjax_request_finished_total{finished_reason="abort"}'
    for _ in range(300):
        now = _metrics(server)
        if now.get(aborted, 0) > idle.get(aborted, 0) and now["lmjax_kv_cache_free_blocks"] == \
                idle["lmjax_kv_cache_free_blocks"]:
            break
        time.sleep(0.2)
    assert now["lmjax_kv_cache_free_blocks"] == idle["lmjax_kv_cache_free_blocks"]
    assert now.get(aborted, 0) == idle.get(aborted, 0) + 1


def _post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(f"{server}{path}", content=raw, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("path, body, raw, key, status", [
    ("/v1/completions", None, b'{"model": "m", "prompt": ', KEY, 400),  # malformed JSON
    ("/v1/completions", {"prompt": "hi", "max_tokens": "five"}, None, KEY, 400),
    ("/v1/chat/completions", {"messages": "hi"}, None, KEY, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, KEY, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, None, KEY, 400),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, None, KEY, 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, None, KEY, 404),
    ("/v1/completions", {"prompt": "hi " * 3000}, None, KEY, 400),  # over session_len
    ("/v1/completions", {"prompt": "hi " * 3000, "stream": True}, None, KEY, 400),
    ("/v1/completions", {"prompt": "hi"}, None, None, 401),
    ("/v1/completions", {"prompt": "hi"}, None, "sk-wrong", 401),
    ("/v1/models", None, None, "sk-wrong", 401),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": SESSION_LEN}, None, KEY, 400),  # over the context
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, None, KEY, 400),  # would wrap onto seed 0
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, None, KEY, 400),  # without logprobs
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None, KEY, 400),  # no stream
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, None, KEY, 400),  # user last
])
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, model_id, path, body, raw, key, status):
    if body is not None and "model" not in body and path != "/v1/chat/interactive":
        body = {"model": model_id, **body}
    resp = httpx.get(f"{server}{path}", headers={"Authorization": f"Bearer {key}"}) if body is None and raw is None \
        else _post(server, path, body, key, raw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    good = _post(server, "/v1/completions", {"model": model_id, "prompt": "Hi", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, extra, named", [
    ("/v1/chat/completions", {"tools": [TOOL]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),  # json_object etc. work
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "image_url"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": " and that is all."}, "suffix"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # (as vLLM)
])
def test_openai_fields_lmjax_does_not_honour_are_named_not_ignored(server, model_id, path, extra, named):
    body = {"model": model_id, "max_tokens": 2, **({"messages": CHAT} if "chat" in path else {"prompt": "Hi"}), **extra}
    resp = _post(server, path, body)
    assert resp.status_code == 400 and named in resp.json()["error"]["message"], resp.text


def test_text_content_parts_are_joined_by_newlines():
    from lmjax.serve.protocol import ChatMessage

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert ChatMessage(role="user", content=parts).text() == "Hi\nthere"  # as vLLM joins them
    assert ChatMessage(role="assistant", content=None).text() == ""


def test_those_fields_at_their_no_op_values_are_accepted(server, model_id):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2, tools=[TOOL])
    out = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2, tools=[], tool_choice="none",
                                         response_format={"type": "text"}, logit_bias={})
    assert out.usage.completion_tokens == 2
    out = client.completions.create(model=model_id, prompt="Hi", max_tokens=2, best_of=1)  # (suffix "": vLLM's 400)
    assert out.usage.completion_tokens == 2


def test_openai_client_raises_typed_errors(server, model_id):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="bad").models.list()
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=model_id, prompt="hi", top_p=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_interactive_session_reuses_kv_and_matches_whole_history(server, llm):
    from lmjax.serve import APIClient

    tok = llm.get_tokenizer()
    api = APIClient(server, api_key=KEY)
    greedy = dict(temperature=0, top_k=1, request_output_len=10)
    one = next(api.chat_interactive_v1("Hi, my name is Bob.", session_id=7, interactive_mode=True, **greedy))
    before = _metrics(server)["lmjax_prompt_tokens_total"]
    pieces = list(api.chat_interactive_v1("What is my name?", session_id=7, interactive_mode=True, stream=True,
                                          **greedy))
    prefilled = _metrics(server)["lmjax_prompt_tokens_total"] - before
    two = "".join(p["text"] for p in pieces)
    assert pieces[-1]["history_tokens"] == one["input_tokens"] + one["tokens"]
    assert prefilled == pieces[-1]["input_tokens"] + 1 < pieces[-1]["history_tokens"]  # + the reply's last token

    # The same conversation as one request holding the whole history, offline.
    first_ids = tok.apply_chat_template([{"role": "user", "content": "Hi, my name is Bob."}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    reply = llm.generate({"prompt_token_ids": first_ids}, _greedy(10), use_tqdm=False)[0].outputs[0]
    assert reply.text == one["text"]
    closed = reply.token_ids[-1] == tok.eos_token_id
    turn = ("" if closed else "<|im_end|>") + "\n<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n"
    history = first_ids + reply.token_ids + tok(turn, add_special_tokens=False)["input_ids"]
    assert len(history) == pieces[-1]["history_tokens"] + pieces[-1]["input_tokens"]
    assert llm.generate({"prompt_token_ids": history}, _greedy(10), use_tqdm=False)[0].outputs[0].text == two

    end = next(api.chat_interactive_v1("", session_id=7, interactive_mode=False))
    assert end["finish_reason"] == "stop" and _metrics(server)["lmjax_num_sessions"] == 0


def test_api_client_endpoints(server, model_id):
    from lmjax.serve import APIClient, APIClientError

    api = APIClient(server, api_key=KEY)
    assert api.available_models == [model_id]
    whole = next(api.chat_completions_v1(model_id, CHAT, temperature=0, max_tokens=5))
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in api.chat_completions_v1(model_id, CHAT, temperature=0, max_tokens=5, stream=True))
    assert whole["choices"][0]["message"]["content"] == streamed
    whole = next(api.completions_v1(model_id, PROMPTS[0], temperature=0, max_tokens=5))
    streamed = "".join(c["choices"][0]["text"]
                       for c in api.completions_v1(model_id, PROMPTS[0], temperature=0, max_tokens=5, stream=True))
    assert whole["choices"][0]["text"] == streamed
    with pytest.raises(APIClientError, match="401"):
        APIClient(server).available_models


def test_echo_with_logprobs_scores_the_prompt(server, model_id, llm):
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens get log-probabilities (the first
    none), equal to the engine's prompt logprobs, and offsets into the echoed text; streamed alike."""
    from lmjax import SamplingParams

    ids = llm.get_tokenizer()(PROMPTS[0])["input_ids"]
    body = {"model": model_id, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    got = _post(server, "/v1/completions", body).json()["choices"][0]
    lp = got["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    want = [e[t].logprob for t, e in zip(ids[1:], ref.prompt_logprobs[1:])]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert got["text"] == llm.get_tokenizer().decode(ids) + ref.outputs[0].text
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(llm.get_tokenizer().decode(ids))
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "max_tokens": 3, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as resp:
        import json

        chunks = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data: {")]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(ids) + 3 and offsets[len(ids)] == len(llm.get_tokenizer().decode(ids))
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert len({c["created"] for c in chunks}) == 1  # one time stamp for the whole stream


def test_null_fields_mean_their_defaults(server, model_id):
    """openai-python sends an option passed as None as JSON null: OpenAI's optional fields are nullable."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    out = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=3, temperature=None, top_p=None,
                                         n=None, presence_penalty=None, frequency_penalty=None, stream=None,
                                         logprobs=None, seed=None, stop=None)
    assert out.usage.completion_tokens == 3 and len(out.choices) == 1
    out = client.completions.create(model=model_id, prompt="Hi", max_tokens=3, temperature=None, echo=None, n=None)
    assert out.usage.completion_tokens == 3
    resp = _post(server, "/v1/completions", {"model": model_id, "prompt": "Hi", "temperature": "hot"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"


def test_vllm_extensions_are_honoured(server, model_id, llm):
    from lmjax import SamplingParams

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    full = llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[1]
    got = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert got.choices[0].text == full[:full.index(stop) + len(stop)]
    got = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"bad_words": [stop]})
    assert stop not in got.choices[0].text
    # assistant prefill: the last message left open, the model goes on with it
    prefill = CHAT + [{"role": "assistant", "content": "The tallest mountain is"}]
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(prefill, tokenize=True, continue_final_message=True, return_dict=True)["input_ids"]
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    got = client.chat.completions.create(model=model_id, messages=prefill, max_tokens=6, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.content == want[0].outputs[0].text
    plain = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=1)
    bare = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens
    assert client.models.retrieve(model_id).id == model_id


def test_openai_requests_never_take_an_interactive_sessions_id(server, model_id):
    """Interactive clients pick any session id; one next in line for OpenAI requests keeps its history."""
    greedy = {"temperature": 0, "top_k": 1, "request_output_len": 4}
    probe = _post(server, "/v1/chat/interactive", {"prompt": "Hi", **greedy}).json()["session_id"]
    mine = probe + 1  # the id the next OpenAI request would have taken
    first = _post(server, "/v1/chat/interactive", {"prompt": "My name is Bob.", "session_id": mine,
                                                   "interactive_mode": True, **greedy}).json()
    assert _post(server, "/v1/completions", {"model": model_id, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    again = _post(server, "/v1/chat/interactive", {"prompt": "What is my name?", "session_id": mine,
                                                   "interactive_mode": True, **greedy}).json()
    assert again["history_tokens"] == first["input_tokens"] + first["tokens"] > 0
    _post(server, "/v1/chat/interactive", {"prompt": "", "session_id": mine})


def test_encode_route_and_client_match_the_tokenizer(server, llm):
    """LMDeploy's `/v1/encode` and `APIClient.encode`: (input_ids, length), lists of each for a list input."""
    from lmjax.serve import APIClient

    tok, api = llm.get_tokenizer(), APIClient(server, api_key=KEY)
    plain = tok(PROMPTS[0])["input_ids"]
    assert api.encode(PROMPTS[0]) == (plain, len(plain))
    ids, lengths = api.encode(PROMPTS[:2])
    assert ids == [tok(p)["input_ids"] for p in PROMPTS[:2]] and lengths == [len(i) for i in ids]
    chat = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert api.encode(CHAT[0]["content"], do_preprocess=True) == (chat, len(chat))
    later, _ = api.encode(CHAT[0]["content"], do_preprocess=True, add_bos=False)  # a later turn: no system prompt
    assert "system" not in tok.decode(later) and tok.decode(chat).endswith(tok.decode(later))
    assert _post(server, "/v1/encode", {"input": "hi"}, key="sk-wrong").status_code == 401


def test_api_client_chat_and_end_session(server):
    """LMDeploy's APIClient.chat (a turn of a kept session, yielding (text, tokens, finish_reason)) and
    end_session (which forgets the history, also of a session that has none)."""
    from lmjax.serve import APIClient

    api, sid = APIClient(server, api_key=KEY), 4242
    (text, tokens, reason), = api.chat("My name is Bob.", sid, request_output_len=4, temperature=0, top_k=1)
    assert isinstance(text, str) and 0 < tokens <= 4 and reason in ("stop", "length")
    pieces = list(api.chat("What is my name?", sid, request_output_len=3, stream=True, temperature=0, top_k=1))
    assert all(len(p) == 3 for p in pieces) and pieces[-1][2] in ("stop", "length")
    probe = dict(session_id=sid, interactive_mode=True, request_output_len=1)
    assert next(api.chat_interactive_v1("Hi", **probe))["history_tokens"] > 0
    assert api.end_session(sid) is None
    assert next(api.chat_interactive_v1("Hi", **probe))["history_tokens"] == 0  # forgotten
    api.end_session(sid)
    api.end_session(987654)  # no such session: nothing to do, as in LMDeploy (was a 400)
    with pytest.raises(ValueError, match="session_id"):
        next(api.chat("hi", -1))


def test_interactive_cancel_needs_a_session_id(server):
    resp = _post(server, "/v1/chat/interactive", {"prompt": "", "cancel": True})
    assert resp.status_code == 400 and "session_id" in resp.json()["error"]["message"], resp.text
    resp = _post(server, "/v1/chat/interactive", {"prompt": "", "cancel": True, "session_id": 31337})
    assert resp.status_code == 200 and resp.json()["session_id"] == 31337
    # LMDeploy's answer to a cancel, field for field
    assert {k: resp.json()[k] for k in ("text", "tokens", "history_tokens", "finish_reason")} == {
        "text": "", "tokens": 0, "history_tokens": 0, "finish_reason": "stop"}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udc80"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
    ("/v1/completions", {"prompt": "hi \udc80"}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\udc80"]}, "stop"),
    ("/v1/chat/interactive", {"prompt": "hi \udc80", "session_id": 5}, "prompt"),
    ("/v1/encode", {"input": ["ok", "\udc80"]}, "input"),
])
def test_lone_surrogate_is_a_400_naming_the_field(server, model_id, path, body, field):
    """JSON can carry a lone surrogate ("\\udc80"), which UTF-8 cannot encode and no tokenizer takes."""
    import json

    if path in ("/v1/chat/completions", "/v1/completions"):
        body = {"model": model_id, "max_tokens": 2, **body}
    resp = _post(server, path, None, raw=json.dumps(body).encode())  # json.dumps escapes it as \udc80
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and "not valid UTF-8" in error["message"] and field in error["message"]
