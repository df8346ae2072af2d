"""A checkpoint's generation_config.json: its EOS ids end a reply (Llama-3-Instruct names <|eot_id|> only
there), and its sampling fields are vLLM's defaults for LLM.generate without SamplingParams and for what
an OpenAI request leaves out."""
import json
import os

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("plain"), eos_token_id=3, initializer_range=0.2)


def _with_generation_config(plain, tmp_path, **fields):
    path = tmp_path / "model"  # the same weights (links), another generation_config.json
    path.mkdir()
    for name in set(os.listdir(plain)) - {"generation_config.json"}:
        os.symlink(os.path.join(plain, name), path / name)
    (path / "generation_config.json").write_text(json.dumps(fields))
    return str(path)


def test_generation_config_eos_ids_stop_generation(plain, tmp_path):
    tokens = LLM(plain, max_model_len=128).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eot = tokens[4]
    assert 3 not in tokens[:5] and eot != 3  # config.json's EOS (3) comes later, if at all
    path = _with_generation_config(plain, tmp_path, eos_token_id=[3, eot])
    llm = LLM(path, max_model_len=128)
    assert eot in llm.llm_engine.eos_token_ids and 3 in llm.llm_engine.eos_token_ids
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    first = tokens.index(eot)
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop"
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(ignored[0].outputs[0].token_ids) == 20 and ignored[0].outputs[0].token_ids[:len(tokens)] == tokens


def test_generation_config_sampling_fields_are_the_defaults(plain, tmp_path):
    path = _with_generation_config(plain, tmp_path, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7,
                                   do_sample=True)
    llm = LLM(path, max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # no SamplingParams: the model's defaults
    assert len(out.token_ids) == 7
    assert LLM(path, max_model_len=128, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    assert LLM(plain, max_model_len=128, generation_config=path).get_default_sampling_params().temperature == 0.6
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        LLM(plain, generation_config="nowhere")


def test_openai_requests_take_the_model_defaults_for_fields_they_leave_out():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    chat = dict(model="m", messages=[{"role": "user", "content": "hi"}])
    left_out = ChatCompletionRequest(**chat).sampling_params(defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 20)
    given = ChatCompletionRequest(**chat, temperature=1.0, top_k=0).sampling_params(defaults)
    assert (given.temperature, given.top_p, given.top_k) == (1.0, 0.9, 0)
    null = ChatCompletionRequest.model_validate({**chat, "temperature": None})
    assert null.sampling_params(defaults).temperature == 0.6
    assert CompletionRequest(model="m", prompt="hi").sampling_params(defaults).top_p == 0.9
    assert ChatCompletionRequest(**chat).sampling_params().temperature == 1.0  # OpenAI's without a model default


def test_server_generation_config_flag(plain, tmp_path, capsys):
    """vLLM's `--generation-config auto|vllm|DIR`: which defaults the fields a request leaves out take."""
    from fastapi.testclient import TestClient

    from lmjax.cli import main
    from lmjax.loader.generation_config import chosen_sampling_defaults
    from lmjax.serve.openai_server import create_app

    path = _with_generation_config(plain, tmp_path, temperature=0.0, max_new_tokens=3, do_sample=False)
    model_defaults = {"temperature": 0.6}
    assert chosen_sampling_defaults("auto", model_defaults) == model_defaults
    assert chosen_sampling_defaults("vllm", model_defaults) == {}
    assert chosen_sampling_defaults(path, model_defaults) == {"temperature": 0.0, "max_tokens": 3}
    with pytest.raises(SystemExit) as e:
        main(["serve", "api_server", plain, "--generation-config", "nowhere"])  # before the model loads
    assert e.value.code == 2 and "--generation-config='nowhere' must be" in capsys.readouterr().err
    seen = []

    def validate_request(self, ids, params):  # records what the server would submit, then refuses it
        seen.append(params)
        raise ValueError("recorded")

    class Engine:
        model_name, tokenizer, session_len = "m", None, 100
        engine = type("E", (), {"sampling_defaults": model_defaults, "validate_request": validate_request,
                                "blocks": type("B", (), {"num_usable_blocks": 64})()})()

    for defaults, want in ((None, 0.6), ({}, 1.0)):
        client = TestClient(create_app(Engine(), sampling_defaults=defaults))
        resp = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert resp.status_code == 400 and seen.pop().temperature == want
