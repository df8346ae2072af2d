"""OpenAI's POST /v1/embeddings through the official `openai` client, in process, on a tiny random float32
Llama (word-level vocabulary t0..t255, no BOS added; t0, t1, t2 are special tokens that also match inside
words, so prompts avoid t1x and t2x; session_len 64). Embeddings must equal `LLM.embed` on the same
checkpoint and transformers' final-norm hidden state of the last prompt token (L2-normalized); base64 decodes
to the same floats; every bad input is a 400 (an unknown model a 404) naming the value, after which the server
still serves; the inputs of one request reach the engine together, between two steps."""
import base64

import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from conftest import write_tiny_llama

SESSION_LEN = 64
PROMPTS = ["t5 t9 t42 t30", "t7 t8", "t40"]
IDS = [[5, 9, 42, 30], [7, 8], [40]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


@pytest.fixture(scope="module")
def engine(path):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    engine = AsyncEngine(path, model_name="tiny", backend_config=TurbomindEngineConfig(
        session_len=SESSION_LEN, cache_block_seq_len=16))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(engine):
    from lmjax.serve.openai_server import create_app

    with TestClient(create_app(engine)) as http:
        yield http


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def llm(path):
    from lmjax import LLM

    return LLM(path, max_model_len=SESSION_LEN, block_size=16)


@pytest.fixture(scope="module")
def hf_hidden(path):
    """Token ids -> transformers' final-norm hidden state of the last token (float32)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
    return hidden


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], np.float32)


def test_embeddings_equal_llm_embed_and_transformers(client, llm, hf_hidden):
    got = client.embeddings.create(model="tiny", input=PROMPTS)  # openai-python asks for base64 and decodes it
    offline = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in offline] == IDS
    np.testing.assert_allclose(_vectors(got), [o.outputs.embedding for o in offline], atol=1e-5)
    ref = np.array([hf_hidden(ids) for ids in IDS])
    np.testing.assert_allclose(_vectors(got), ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5)
    assert [d.index for d in got.data] == [0, 1, 2] and {d.object for d in got.data} == {"embedding"}
    assert got.object == "list" and got.model == "tiny" and got.id.startswith("embd-") and got.created > 0
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (7, 7)


def test_float_and_base64_encodings_carry_the_same_floats(client):
    floats = client.embeddings.create(model="tiny", input=PROMPTS[:2], encoding_format="float")
    b64 = client.embeddings.create(model="tiny", input=PROMPTS[:2], encoding_format="base64")
    assert all(isinstance(d.embedding, list) and len(d.embedding) == 64 for d in floats.data)
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in b64.data]
    np.testing.assert_allclose(decoded, _vectors(floats), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), 1.0, atol=1e-5)


def test_token_ids_truncation_and_raw_hidden_state(client, hf_hidden):
    by_text = _vectors(client.embeddings.create(model="tiny", input=PROMPTS, encoding_format="float"))
    by_ids = client.embeddings.create(model="tiny", input=IDS, encoding_format="float")
    np.testing.assert_allclose(_vectors(by_ids), by_text, atol=1e-6)
    one = client.embeddings.create(model="tiny", input=IDS[0], encoding_format="float")  # one list of ids
    np.testing.assert_allclose(_vectors(one)[0], by_text[0], atol=1e-6)
    raw = client.embeddings.create(model="tiny", input="t7 t8", encoding_format="float",
                                   extra_body={"normalize": False})
    np.testing.assert_allclose(raw.data[0].embedding, hf_hidden([7, 8]), atol=1e-5)
    assert abs(np.linalg.norm(raw.data[0].embedding) - 1.0) > 0.1  # really not normalized
    cut = client.embeddings.create(model="tiny", input="t5 t9 t42 t30", extra_body={"truncate_prompt_tokens": 2})
    np.testing.assert_allclose(_vectors(cut)[0], _vectors(client.embeddings.create(model="tiny", input=[42, 30]))[0],
                               atol=1e-6)
    assert cut.usage.prompt_tokens == 2  # usage counts the tokens embedded, after truncation


def test_the_longest_input_is_the_context_less_one(client, llm):
    ids = [(7 * i) % 250 + 4 for i in range(SESSION_LEN + 6)]
    got = client.embeddings.create(model="tiny", input=[ids], extra_body={"truncate_prompt_tokens": -1})
    assert got.usage.prompt_tokens == SESSION_LEN - 1
    want = llm.embed([{"prompt_token_ids": ids[-(SESSION_LEN - 1):]}], use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(_vectors(got)[0], want, atol=1e-5)


def test_chat_messages_embed_as_the_template_renders_them(http, client):
    chat = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
    got = http.post("/v1/embeddings", json={"model": "tiny", "messages": chat})
    assert got.status_code == 200, got.text
    ids = http.post("/tokenize", json={"messages": chat, "add_generation_prompt": False}).json()["tokens"]
    assert got.json()["usage"]["prompt_tokens"] == len(ids)
    want = client.embeddings.create(model="tiny", input=ids, encoding_format="float").data[0].embedding
    np.testing.assert_allclose(got.json()["data"][0]["embedding"], want, atol=1e-6)


def test_inputs_of_one_request_are_queued_between_the_same_two_steps(client, engine, monkeypatch):
    inner, steps, seen = engine.engine, [0], []
    step, add = inner.step, inner.add_request

    def counting_step():
        steps[0] += 1
        return step()

    def recording_add(*args, **kwargs):
        seen.append(steps[0])
        return add(*args, **kwargs)
    monkeypatch.setattr(inner, "step", counting_step)
    monkeypatch.setattr(inner, "add_request", recording_add)
    client.embeddings.create(model="tiny", input=["t41 t42", "t43", "t44 t45 t46", "t47"])
    assert len(seen) == 4 and len(set(seen)) == 1, seen


@pytest.mark.parametrize("body, status, named", [
    ({"input": []}, 400, "input=[] is empty"),
    ({"input": ""}, 400, "input is an empty string"),
    ({"input": ["t5", ""]}, 400, "input[1] is an empty string"),
    ({"input": [[5], []]}, 400, "input[1] has no tokens"),
    ({"input": [[5, 256]]}, 400, "input[0] token ids [256] are outside the vocabulary [0, 256)"),
    ({"input": [5, -1]}, 400, "input token ids [-1] are outside the vocabulary"),
    ({"input": " ".join(["t5"] * SESSION_LEN)}, 400, f"input has {SESSION_LEN} tokens, but this model's maximum "
                                                     f"context length is {SESSION_LEN}"),
    ({"input": "t5", "dimensions": 32}, 400, "dimensions=32 is not supported"),
    ({"input": "t5", "truncate_prompt_tokens": SESSION_LEN}, 400, f"truncate_prompt_tokens={SESSION_LEN}"),
    ({"input": "t5", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "t5", "messages": [{"role": "user", "content": "t5"}]}, 400, "exactly one of input and messages"),
    ({"input": "t5", "model": "other"}, 404, "'other'"),
])
def test_bad_requests_name_the_value_and_the_server_goes_on(http, client, body, status, named):
    got = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error", error
    assert len(client.embeddings.create(model="tiny", input="t5 t6").data[0].embedding) == 64


def test_the_openai_client_raises_its_errors(client):
    with pytest.raises(openai.BadRequestError, match="input\\[0\\] token ids \\[300\\]"):
        client.embeddings.create(model="tiny", input=[[300]])
    with pytest.raises(openai.NotFoundError, match="other"):
        client.embeddings.create(model="other", input="t5")


def test_api_client_embeddings_v1(http):
    from lmjax.serve.client import APIClient

    api = APIClient("http://testserver")
    api._http = http  # the in-process app instead of a socket
    body = api.embeddings_v1("tiny", ["t5 t9", "t7"], normalize=False)
    assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"]["prompt_tokens"] == 3
