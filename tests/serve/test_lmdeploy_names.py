"""LMDeploy's import paths and module-level names, as lagent and LMDeploy users write them with `lmdeploy`
replaced by `lmjax`: version_info, lmjax.messages, lmjax.pytorch / lmjax.turbomind, lmjax.client,
lmjax.serve(...) (a server in a subprocess), lmjax.serve.openai.api_client, APIClient.headers, json_loads."""
import inspect
import json
import logging
import os
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request

import pytest

import lmjax
from conftest import REPO, write_tiny_llama
from lmjax.serve.client import APIClient, json_loads
from server_process import free_port

KEY = "sk-lmdeploy-names"
GREEDY = dict(temperature=0, top_k=1)


def test_lmdeploy_import_paths_give_lmjax_names():
    from lmjax import ChatTemplateConfig, TurbomindEngineConfig, pipeline, version_info  # noqa: F401  (lagent's)
    from lmjax.messages import GenerationConfig, PytorchEngineConfig, Response
    from lmjax.pytorch import EngineConfig as TorchEngineConfig
    from lmjax.serve.openai import api_client
    from lmjax.turbomind import EngineConfig as TMEngineConfig

    assert (GenerationConfig, Response) == (lmjax.GenerationConfig, lmjax.Response)
    assert TorchEngineConfig is PytorchEngineConfig is lmjax.PytorchEngineConfig
    assert TMEngineConfig is TurbomindEngineConfig
    assert TMEngineConfig(tp=1, session_len=1024).session_len == 1024  # the seed's example
    assert (api_client.APIClient, api_client.json_loads) == (APIClient, json_loads)
    assert isinstance(lmjax.client("http://127.0.0.1:1", api_key="k"), APIClient)


def test_version_info_is_the_lmdeploy_api_release_mirrored():
    """lagent: `version_info < (0, 6, 0)` rejects do_sample, which lmjax's GenerationConfig takes."""
    assert lmjax.version_info == (0, 6, 0) and all(isinstance(p, int) for p in lmjax.version_info)
    assert not lmjax.version_info < (0, 6, 0)
    assert lmjax.GenerationConfig(do_sample=True).top_k == 50  # what that path relies on
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert lmjax.__version__ == tomllib.load(f)["project"]["version"]  # lmjax's own release


@pytest.mark.parametrize("script", [
    # the function first, then the subpackage's modules
    "import lmjax; assert callable(lmjax.serve); import lmjax.serve.client; "
    "from lmjax.serve.openai_server import create_app; from lmjax.serve.openai.api_client import APIClient",
    # the modules first, then the function
    "from lmjax.serve.openai_server import create_app; import lmjax.serve.client; "
    "import lmjax.serve.openai.api_client; from lmjax import serve; import lmjax; assert serve is lmjax.serve",
])
def test_serve_is_callable_and_a_package_in_any_import_order(script):
    check = ("; import sys, openai; assert lmjax.serve is sys.modules['lmjax.serve']; "
             "assert hasattr(openai, 'OpenAI'), 'lmjax.serve.openai shadowed the openai package'\n"
             "try: lmjax.serve('m', ssl=True)\nexcept NotImplementedError: pass  # the call reached serve()")
    subprocess.run([sys.executable, "-c", script + check], check=True, cwd=REPO, timeout=120)


def test_headers_carry_the_api_key_as_lmdeploy_sets_them():
    plain = {"content-type": "application/json"}
    assert APIClient("http://127.0.0.1:1").headers == plain
    assert APIClient("http://127.0.0.1:1", api_key=KEY).headers == {**plain, "Authorization": f"Bearer {KEY}"}
    assert APIClient("http://h:1").chat_intractive_v1_url == "http://h:1/v1/chat/interactive"  # LMDeploy's typo


def test_json_loads_decodes_text_and_bytes_and_gives_empty_for_the_rest(caplog):
    assert json_loads('{"a": [1]}') == json_loads(b'{"a": [1]}') == {"a": [1]}
    with caplog.at_level(logging.WARNING, logger="lmjax.serve"):
        assert json_loads(b"data: [DONE]") == ""
    assert "weird json content" in caplog.text


def test_chat_interactive_v1_asks_for_512_tokens_by_default_as_lmdeploy():
    assert inspect.signature(APIClient.chat_interactive_v1).parameters["request_output_len"].default == 512


def test_serve_arguments_become_api_server_flags():
    from lmjax.serve.launch import _engine_options, api_server_argv

    engine = _engine_options(lmjax.TurbomindEngineConfig(session_len=64, cache_block_seq_len=32), tp=2)
    argv = api_server_argv("m", {**engine, "api_keys": ["a", "b"], "tool_call_parser": "hermes"})
    flags = " ".join(argv)
    for expected in ("serve api_server m", "--session-len 64", "--cache-block-seq-len 32", "--tp 2",
                     "--api-keys a b", "--tool-call-parser hermes"):
        assert expected in flags
    with pytest.raises(TypeError, match="no_such_option"):
        api_server_argv("m", {"no_such_option": 1})
    with pytest.raises(ValueError, match="server-port"):
        api_server_argv("m", {"server_port": -1})
    with pytest.raises(ValueError, match="num_scheduler_steps=2"):  # an engine field the server cannot be given
        _engine_options(lmjax.EngineConfig(num_scheduler_steps=2), None)
    assert "--max-logprobs 5" in " ".join(api_server_argv("m", _engine_options(lmjax.EngineConfig(max_logprobs=5),
                                                                                None)))  # (one it can: review 32)
    with pytest.raises(NotImplementedError, match="ssl"):
        lmjax.serve("m", ssl=True)


def test_serve_raises_with_the_stderr_of_a_server_that_exits():
    with pytest.raises(RuntimeError, match="(?s)exited.*neither a local path"):
        lmjax.serve(os.path.join(REPO, "no-such-model"), server_port=free_port())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("lmdeploy-names") / "tiny")


def test_serve_starts_a_server_that_lmdeploy_and_lagent_code_can_use(tiny_model):
    """lagent's LMDeployServer call (plus a chat template whose markers the tiny word-level vocabulary has,
    and an API key); one server for every check, as its start and first compilation are the cost here."""
    template = lmjax.ChatTemplateConfig(user="t1 ", eoh=" t2", assistant=" t3")
    api = lmjax.serve(tiny_model, model_name="tiny", server_name="0.0.0.0", server_port=free_port(), tp=1,
                      log_level="WARNING", api_keys=KEY, chat_template_config=template, session_len=128,
                      startup_timeout=300)
    try:
        _check_client(api)
        for stream in (False, True):
            _check_lagent_async_request(api, stream)
    finally:
        api.server_process.stop()
    assert not api.server_process.running
    with pytest.raises(ConnectionError):
        APIClient(api.api_server_url, timeout=5).available_models


def _check_client(api: APIClient) -> None:
    assert api.available_models == ["tiny"] and api.server_process.running
    assert api.api_server_url == api.server_process.url and "127.0.0.1" in api.api_server_url
    out = next(api.chat_completions_v1("tiny", "t5", max_tokens=4, **GREEDY))
    assert out["usage"]["completion_tokens"] == 4
    templated, _ = api.encode("t5", do_preprocess=True, add_bos=False)  # the template file reached it
    assert templated == api.encode("t1 t5 t2 t3", add_bos=False)[0]
    # a prompt past session_len (128): LMDeploy's "run out of tokens", an empty "length" answer, not an error
    (over,) = api.chat_interactive_v1("t5 " * 200, session_id=7)
    assert (over["text"], over["tokens"], over["finish_reason"]) == ("", 0, "length")


def _lagent_texts(url: str, headers: dict, payload: dict, n: int) -> list[str]:
    """lagent's AsyncLMDeployServer reading: POST with `headers` as given, each line of the answer (aiohttp's
    `async for chunk in resp.content`) less SSE's `data: ` decoded with json_loads, choices' texts joined."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    texts = [""] * n
    with urllib.request.urlopen(request, timeout=120) as resp:
        for line in resp:
            decoded = line.decode().strip()
            if not decoded or decoded == "data: [DONE]":
                continue
            for choice in json_loads(decoded.removeprefix("data: "))["choices"]:
                texts[choice["index"]] += choice["text"]
    return texts


def _check_lagent_async_request(api: APIClient, stream: bool) -> None:
    """lagent's own payload (its top_k=None, stop_words and session fields included) posted to
    `completions_v1_url` with `headers=client.headers` (which carry the API key)."""
    prompts = ["t5 t6"] if stream else ["t5 t6", "t7"]  # stream_chat sends one prompt, generate a batch
    payload = dict(model="tiny", prompt=prompts[0] if stream else prompts, sequence_start=True,
                   sequence_end=True, stream=stream, ignore_eos=True, skip_special_tokens=False, timeout=30,
                   max_tokens=3, top_p=0.8, top_k=None, temperature=0, repetition_penalty=1.0, stop_words=None)
    texts = _lagent_texts(api.completions_v1_url, api.headers, payload, len(prompts))
    for prompt, text in zip(prompts, texts):
        expected = next(api.completions_v1("tiny", prompt, max_tokens=3, ignore_eos=True,
                                           skip_special_tokens=False, **GREEDY))["choices"][0]["text"]
        assert text and text == expected, (stream, prompt)
    with pytest.raises(urllib.error.HTTPError, match="401"):  # the key in the headers is what let it in
        _lagent_texts(api.completions_v1_url, {"content-type": "application/json"}, payload, len(prompts))


def test_served_process_stops_when_the_python_process_exits(tiny_model):
    port = free_port()
    script = f"import lmjax; lmjax.serve({tiny_model!r}, server_port={port}, session_len=64)"
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, timeout=300)
    with pytest.raises(ConnectionError):  # atexit stopped it (and waited) before the interpreter ended
        APIClient(f"http://127.0.0.1:{port}", timeout=5).available_models
