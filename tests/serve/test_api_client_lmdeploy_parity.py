"""APIClient against an in-process server, where it departed from LMDeploy's client (probe 25): a streamed
line cut at U+2028 / U+2029 / U+0085 (httpx's iter_lines splits there; SSE only at line ends) and raised a
JSONDecodeError; an error inside a stream was always status 500; chat_completions_v1's top_k default was 0
(LMDeploy's 40); max_tokens=None was dropped, so the server's default of 16 applied; get_model_list took a
base URL (LMDeploy's takes the /v1/models URL and headers, and answers None on an error)."""
import inspect

import httpx
import pytest

from lmjax.serve import client as client_module
from lmjax.serve.client import APIClient, APIClientError, get_model_list
from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)


@pytest.fixture
def api(http):
    api = APIClient(str(http.base_url))
    api._http = http  # the in-process app's httpx client
    return api


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85"])
def test_a_unicode_line_separator_streams_whole(api, sep):
    prompt = f"t5{sep}t6"
    chunks = list(api.completions_v1("tiny", prompt, max_tokens=2, temperature=0, echo=True, stream=True))
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text.startswith(prompt)


def test_an_error_inside_a_stream_keeps_the_servers_status(api):
    nothing = dict(max_tokens=4, temperature=0, allowed_token_ids=[5], bad_words=["t5"])  # nothing to sample
    with pytest.raises(APIClientError) as whole:
        next(api.completions_v1("tiny", "t9", **nothing))
    with pytest.raises(APIClientError) as streamed:
        list(api.completions_v1("tiny", "t9", stream=True, **nothing))
    assert whole.value.status == streamed.value.status == 400


def test_lmdeploy_defaults_and_a_null_max_tokens(api):
    assert inspect.signature(APIClient.chat_completions_v1).parameters["top_k"].default == 40
    body = next(api.completions_v1("tiny", "t9", max_tokens=None, temperature=0, ignore_eos=True))
    assert body["usage"]["completion_tokens"] > 16  # to the session's end (256), not the server's default 16


def test_get_model_list_takes_lmdeploys_url_and_headers(http, monkeypatch):
    monkeypatch.setattr(client_module.httpx, "get", lambda url, headers=None: http.get(httpx.URL(url).path,
                                                                                       headers=headers))
    base = str(http.base_url).rstrip("/")
    assert get_model_list(f"{base}/v1/models", headers={"content-type": "application/json"}) == ["tiny"]
    assert get_model_list(base) == ["tiny"]
    assert get_model_list(f"{base}/v1/nothing/models") is None  # a 404: LMDeploy logs it and answers None


def test_lmdeploys_module_functions_run_an_interactive_turn(http, monkeypatch, capsys):
    """get_streaming_response / input_prompt / main of lmdeploy.serve.openai.api_client (`lmdeploy serve
    api_client URL`) were missing."""
    from lmjax.serve.openai import api_client

    monkeypatch.setattr(api_client.APIClient, "__init__", _in_process(http))
    monkeypatch.setattr(api_client.APIClient, "close", lambda self: None)  # (the module's http client is shared)
    pieces = list(api_client.get_streaming_response("t5 t6", f"{http.base_url}/v1/chat/interactive", session_id=11,
                                                    request_output_len=3))
    assert pieces and all(len(p) == 3 for p in pieces) and pieces[-1][2] in ("stop", "length")
    lines = iter(["t5 t6", "", "exit", ""])
    monkeypatch.setattr("builtins.input", lambda: next(lines))
    api_client.main(str(http.base_url), session_id=12)
    assert "double enter to end input" in capsys.readouterr().out


def _in_process(http):
    init = APIClient.__init__

    def __init__(self, url, api_key=None, **kwargs):
        init(self, url, api_key, **kwargs)
        self._http = http
    return __init__


def test_serve_api_client_is_a_command():
    from lmjax import cli

    args = cli.build_parser().parse_args(["serve", "api_client", "http://127.0.0.1:1", "--session-id", "3"])
    assert (args.api_server_url, args.session_id, args.api_key) == ("http://127.0.0.1:1", 3, None)
