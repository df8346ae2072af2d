"""APIClient and the terminal chats (review 34): `lmjax serve api_client` had no `end` and no notice of a full
session, took --session-id -1; an error inside /v1/chat/interactive's JSON-lines stream was SSE-framed (the
client failed on it with a JSONDecodeError); the client's 600 s default timeout broke long unstreamed
generations with a raw httpx.ReadTimeout; a 200 that is not JSON, or one JSON body answering stream=True, was
a JSONDecodeError or nothing; `lmjax chat` dropped a message the full session had no room for."""
import concurrent.futures
import contextlib
import io
import json
import socket
import types

import httpx
import pytest

from app_client import app_client
from lmjax import cli
from lmjax.serve import routes_interactive
from lmjax.serve.client import APIClient, APIClientError, APIConnectionError
from tiny_server_fixtures import tiny  # noqa: F401 (pytest fixture)

SESSION_LEN = 64  # tokens a session: the tiny tokenizer adds no BOS, each "tN" word is one


@pytest.fixture(scope="module")
def served(tiny):  # noqa: F811
    with app_client(tiny, SESSION_LEN) as (engine, http):
        yield engine, http


@pytest.fixture
def in_process(served, monkeypatch):
    """Every APIClient talks to the in-process server (and closing one leaves its shared client open)."""
    init = APIClient.__init__

    def __init__(self, url, api_key=None, **kwargs):
        init(self, url, api_key, **kwargs)
        self._http = served[1]
    monkeypatch.setattr(APIClient, "__init__", __init__)
    monkeypatch.setattr(APIClient, "close", lambda self: None)
    return served


def _typed(monkeypatch, lines, seen=None):
    """input() answers `lines` in turn (a message ends at an empty line); `seen(line)` runs before each."""
    it = iter(lines)

    def read(*_):
        line = next(it)
        if seen:
            seen(line)
        return line
    monkeypatch.setattr("builtins.input", read)


def _api_client(session_id: int) -> int:
    return cli.main(["serve", "api_client", "http://testserver", "--session-id", str(session_id)])


# 1. `end` and the full-session notice of `lmjax serve api_client`

def test_api_client_end_ends_the_servers_session_and_goes_on(in_process, monkeypatch):
    engine, _ = in_process
    history = {}
    _typed(monkeypatch, ["t5 t6", "", "end", "", "t8", "", "exit", ""],
           seen=lambda line: history.setdefault(line, engine.id2step.get(21, 0)))
    assert _api_client(21) == 0
    assert history["end"] > 0  # the first turn's history, then `end` ended it: the next turn starts afresh
    assert history["t8"] == 0
    assert engine.id2step.get(21, 0) == 0  # `exit` ended the session too


def test_api_client_says_when_the_session_is_full(in_process, monkeypatch, capsys):
    # the first turn leaves the session 1 or 2 tokens (a reply stops at EOS or at its end): no room for the next
    _typed(monkeypatch, [" ".join(["t5"] * (SESSION_LEN - 2)), "", "t7", "", "exit", ""])
    assert _api_client(22) == 0
    assert "WARNING: exceed session max length. Please end the session." in capsys.readouterr().out


# 3. --session-id -1

@pytest.mark.parametrize("value", ["-1", "-7"])
def test_api_client_refuses_a_negative_session_id(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", "api_client", "http://127.0.0.1:1", "--session-id", value])
    assert exit_.value.code == 2 and value in capsys.readouterr().err


# 2. an error inside the interactive route's stream

def test_an_interactive_stream_error_is_a_json_line(in_process, monkeypatch):
    _, http = in_process
    real = routes_interactive._chain

    async def failing(first, rest, openai=True):  # the engine fails after the first piece
        async with contextlib.aclosing(real(first, rest, openai)) as items:
            async for item in items:
                yield item
                raise RuntimeError("simulated device failure")
    monkeypatch.setattr(routes_interactive, "_chain", failing)
    body = {"prompt": "t5 t6", "session_id": 31, "stream": True, "request_output_len": 4}
    lines = [json.loads(line) for line in http.post("/v1/chat/interactive", json=body).text.splitlines()]
    assert "text" in lines[0] and lines[-1]["error"]["message"] == "simulated device failure"
    with pytest.raises(APIClientError) as info:
        list(APIClient("http://testserver").chat_interactive_v1("t5 t6", session_id=32, stream=True))
    assert info.value.status == 500 and "simulated device failure" in info.value.message


def _faked(status: int, content_type: str, body: bytes) -> APIClient:
    """A client whose every request gets this answer."""
    api = APIClient("http://fake")
    answer = lambda request: httpx.Response(status, headers={"content-type": content_type}, content=body)
    api._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(answer))
    return api


def test_the_client_reads_an_sse_framed_error_in_json_lines():
    """What a server before this fix sent: the interactive stream's error line as `data: {...}`."""
    api = _faked(200, "application/x-ndjson", b'{"text": "a", "tokens": 1, "finish_reason": null}\n'
                 b'data: {"error": {"message": "boom", "type": "server_error", "code": null}}\n\n')
    with pytest.raises(APIClientError) as info:
        list(api.chat_interactive_v1("hi", stream=True))
    assert (info.value.status, info.value.message) == (500, "boom")


# 4. timeouts

def test_the_client_waits_for_a_long_reply_by_default():
    timeout = APIClient("http://127.0.0.1:1")._http.timeout
    assert timeout.read is None and timeout.write is None and 0 < timeout.connect <= 60


@contextlib.contextmanager
def _silent_server():
    """The URL of a server that takes connections and never answers (the kernel accepts them for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_timeout_is_a_connection_error():
    with _silent_server() as url, pytest.raises(APIConnectionError) as info:
        next(APIClient(url, timeout=0.3).completions_v1("m", "p"))
    assert isinstance(info.value.__cause__, httpx.ReadTimeout) and "in time" in str(info.value)


def test_api_client_says_a_timeout_in_one_line(monkeypatch, capsys):
    init = APIClient.__init__
    monkeypatch.setattr(APIClient, "__init__", lambda self, url, api_key=None, **kw: init(self, url, api_key,
                                                                                        timeout=0.3))
    _typed(monkeypatch, ["exit", ""])
    with _silent_server() as url, pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "api_client", url])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "ReadTimeout" in err and "Traceback" not in err


# 5. answers that are not what the request asked for

@pytest.mark.parametrize("call", [
    lambda api: next(api.completions_v1("m", "p")),
    lambda api: api.available_models,
    lambda api: list(api.completions_v1("m", "p", stream=True)),
])
def test_a_200_that_is_not_json_is_a_client_error(call):
    with pytest.raises(APIClientError) as info:
        call(_faked(200, "text/html", b"<html>a proxy's login page</html>"))
    assert info.value.status == 200 and "<html>a proxy" in info.value.message


def test_stream_answered_with_one_json_body():
    body = {"choices": [{"index": 0, "text": "whole", "finish_reason": "stop"}]}
    assert list(_faked(200, "application/json", json.dumps(body).encode()).completions_v1("m", "p", stream=True)) \
        == [body]
    error = {"error": {"message": "overloaded", "type": "server_error", "code": 503}}
    with pytest.raises(APIClientError) as info:
        list(_faked(200, "application/json", json.dumps(error).encode()).completions_v1("m", "p", stream=True))
    assert (info.value.status, info.value.message) == (503, "overloaded")


def test_vllms_older_error_object_in_a_stream():
    chunk = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
    error = b'data: {"object": "error", "message": "boom", "type": "x", "code": 400}\n\n'
    with pytest.raises(APIClientError) as info:
        list(_faked(200, "text/event-stream", chunk + error).completions_v1("m", "p", stream=True))
    assert (info.value.status, info.value.message) == (400, "boom")



def test_a_flat_error_body_gives_its_message():
    """LMDeploy's server answers its 4xx with {"object": "error", "message", ...}: the message, not the JSON text
    (the streamed form was read so already)."""
    error = {"object": "error", "message": "The model 'x' does not exist.", "type": "invalid_request_error",
             "code": 404}
    with pytest.raises(APIClientError) as info:
        list(_faked(404, "application/json", json.dumps(error).encode()).completions_v1("x", "p"))
    assert (info.value.status, info.value.message) == (404, "The model 'x' does not exist.")

# 6. `lmjax chat` when the session is full

class _FullAfterOneTurn:
    """The three calls run_chat makes; a session holds session_len characters of messages."""
    model_name, session_len = "fake", 6

    def __init__(self):
        self.turns, self.used = [], {}

    async def generate(self, text, session_id, gen_config, sequence_start, sequence_end):
        self.turns.append((session_id, sequence_start, text))
        need, used = len(text), self.used.get(session_id, 0)
        if used + need > self.session_len:  # LMDeploy's "run out of tokens": an empty "length" output
            yield types.SimpleNamespace(response="", finish_reason="length", generate_token_len=0,
                                        history_token_len=used, input_token_len=need)
            return
        self.used[session_id] = used + need
        yield types.SimpleNamespace(response=f"re:{text}", finish_reason="stop", generate_token_len=1)

    def end_session(self, session_id):
        self.used.pop(session_id, None)
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_chat_sends_a_message_the_full_session_had_no_room_for_again():
    from lmjax.serve.terminal_chat import run_chat

    engine, out = _FullAfterOneTurn(), io.StringIO()
    run_chat(engine, None, io.StringIO("abcd\n\nefgh\n\nexit\n"), out)
    assert engine.turns == [(1, True, "abcd"), (1, False, "efgh"), (2, True, "efgh")]
    assert "history is reset" in out.getvalue() and "re:efgh" in out.getvalue()


def test_chat_says_a_message_no_session_has_room_for_was_not_sent():
    from lmjax.serve.terminal_chat import run_chat

    engine, out = _FullAfterOneTurn(), io.StringIO()
    run_chat(engine, None, io.StringIO("abcd\n\nefghijk\n\nexit\n"), out)
    assert engine.turns == [(1, True, "abcd"), (1, False, "efghijk"), (2, True, "efghijk")]
    assert "the message was not sent" in out.getvalue()


def test_lmdeploys_main_refuses_a_negative_session_id_before_connecting():
    from lmjax.serve.openai.api_client import main

    with pytest.raises(ValueError, match="session_id=-1 is negative"):
        main("http://127.0.0.1:9", session_id=-1)  # (nothing listens there: the check comes first)
