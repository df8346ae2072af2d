"""`APIClient`: LMDeploy's Python client of the server (what agent frameworks such as lagent call).

Every endpoint method is a generator, as in LMDeploy: it yields the whole response body once, or with
`stream=True` each chunk (OpenAI SSE chunks, or the interactive endpoint's JSON lines). A non-2xx answer
raises `APIClientError` carrying the status and the server's OpenAI-style error message (so does a 200 whose
body is not JSON, a proxy's HTML page, say); a server that cannot be reached raises `APIConnectionError`, a
builtin `ConnectionError` (LMDeploy's client raises requests' ConnectionError, also an OSError, so code
written for it catches this one too), and one that does not answer within `timeout` its subclass
`APITimeoutError`. By default only connecting is timed: a reply may take as long as it takes, as with
LMDeploy's requests-based client (a long non-streamed generation would otherwise fail half-way).

Code that talks HTTP itself next to the client, as lagent's async LMDeploy wrappers do, posts to
`client.completions_v1_url` with `headers=client.headers` and decodes each line with `json_loads`: both
are LMDeploy's, kept here under the same names.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

import httpx

logger = logging.getLogger("lmjax.serve")


def json_loads(content: str | bytes):
    """LMDeploy's helper: JSON text or bytes -> object; content that is not JSON logs a warning and gives
    '' (LMDeploy's answer, which code written for it may test for)."""
    try:
        return json.loads(content)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        logger.warning("weird json content %r", content)
        return ""


class APIClientError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class APIConnectionError(ConnectionError):
    """The server could not be reached (refused, reset, or gone mid-response); the httpx error is the cause."""


class APITimeoutError(APIConnectionError):
    """The server did not answer within the client's `timeout` (openai-python's name for the same case): a
    connection error, so code catching those (the api_client CLI's one-line error) catches it too."""


# What requests reports as a ConnectionError (a timeout is APITimeoutError, caught before these)
_UNREACHABLE = (httpx.NetworkError, httpx.RemoteProtocolError)
CONNECT_TIMEOUT_S = 10.0  # the default limit on connecting; reading has none (see the module's docstring)
_STREAM_TYPES = ("text/event-stream", "application/x-ndjson", "application/jsonl")
SESSION_FULL_NOTICE = "WARNING: exceed session max length. Please end the session."  # LMDeploy's, word for word


class APIClient:
    def __init__(self, api_server_url: str, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = None, **kwargs):
        """`timeout`: seconds (or an httpx.Timeout) for each connect/read/write; None (the default) limits
        connecting to CONNECT_TIMEOUT_S and waits for the reply however long the generation takes."""
        self.api_server_url = api_server_url.rstrip("/")
        self.api_key = api_key
        # LMDeploy's public headers: what the client itself sends is what callers posting on their own reuse
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        if timeout is None:
            timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(base_url=self.api_server_url, headers=self.headers, timeout=timeout)
        self.chat_completions_v1_url = f"{self.api_server_url}/v1/chat/completions"
        self.completions_v1_url = f"{self.api_server_url}/v1/completions"
        self.chat_interactive_v1_url = f"{self.api_server_url}/v1/chat/interactive"
        self.chat_intractive_v1_url = self.chat_interactive_v1_url  # LMDeploy's spelling of the attribute
        self.models_v1_url = f"{self.api_server_url}/v1/models"
        self.encode_v1_url = f"{self.api_server_url}/v1/encode"
        self._models: list[str] | None = None

    @property
    def available_models(self) -> list[str]:
        """Ids of the models the server serves (asked once, then remembered)."""
        if self._models is None:
            with self._reaching():
                body = _json_of(self._check(self._http.get("/v1/models")))
            self._models = [m["id"] for m in body["data"]]
        return self._models

    def chat_completions_v1(self, model: str, messages: str | list[dict], temperature: float = 0.7,
                            top_p: float = 1.0, logprobs: bool = False, top_logprobs: int | None = None, n: int = 1,
                            max_tokens: int | None = None, stop: str | list[str] | None = None,
                            stream: bool = False, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                            user: str | None = None, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, top_k: int = 40, seed: int | None = None,
                            **kwargs) -> Iterator[dict]:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = _payload(locals(), kwargs)
        yield from self._post("/v1/chat/completions", body, stream, sse=True)

    def completions_v1(self, model: str, prompt: str | list, suffix: str | None = None, temperature: float = 0.7,
                       n: int = 1, max_tokens: int | None = 16, stream: bool = False,
                       stop: str | list[str] | None = None, top_p: float = 1.0, top_k: int = 40,
                       user: str | None = None, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                       skip_special_tokens: bool = True, logprobs: int | None = None, echo: bool = False,
                       seed: int | None = None, **kwargs) -> Iterator[dict]:
        body = _payload(locals(), kwargs)
        yield from self._post("/v1/completions", body, stream, sse=True)

    def chat_interactive_v1(self, prompt: str | list[dict], session_id: int = -1, interactive_mode: bool = False,
                            stream: bool = False, stop: str | list[str] | None = None,
                            request_output_len: int | None = 512, top_p: float = 0.8, top_k: int = 40,
                            temperature: float = 0.8, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, cancel: bool = False, seed: int | None = None,
                            **kwargs) -> Iterator[dict]:
        """LMDeploy's session endpoint: `interactive_mode=True` keeps the session's history (and KV cache)
        on the server for the next call with the same `session_id`. `request_output_len` defaults to 512 as
        in LMDeploy's client; None runs to the session's end."""
        body = _payload(locals(), kwargs)
        yield from self._post("/v1/chat/interactive", body, stream, sse=False)

    def encode(self, input: str | list[str], do_preprocess: bool = False,
               add_bos: bool = True) -> tuple[list[int] | list[list[int]], int | list[int]]:
        """(input_ids, length) of a prompt, or a list of each for a list of prompts. `do_preprocess` puts
        each through the chat template first; `add_bos=False` tokenizes it as a later turn (no BOS)."""
        body = next(self._post("/v1/encode", _payload(locals(), {}), stream=False, sse=False))
        return body["input_ids"], body["length"]

    def embeddings_v1(self, model: str, input: str | list, encoding_format: str | None = None,
                      normalize: bool | None = None, truncate_prompt_tokens: int | None = None,
                      **kwargs) -> dict:
        """lmjax's addition (LMDeploy's client has none): OpenAI's /v1/embeddings body, its `data[i].embedding`
        floats (or base64 with encoding_format="base64"), one per input in order."""
        return next(self._post("/v1/embeddings", _payload(locals(), kwargs), stream=False, sse=False))

    def chat(self, prompt: str, session_id: int, request_output_len: int = 512, stream: bool = False,
             top_p: float = 0.8, top_k: int = 40, temperature: float = 0.8, repetition_penalty: float = 1.0,
             ignore_eos: bool = False) -> Iterator[tuple[str, int, str | None]]:
        """One turn of the interactive session `session_id` (its history stays on the server until
        `end_session`): yields (text, tokens, finish_reason), once or, with `stream`, per piece."""
        if session_id == -1:  # LMDeploy asserts this: -1 would start a throwaway session each turn
            raise ValueError("please set a session_id other than -1")
        for out in self.chat_interactive_v1(prompt, session_id=session_id, request_output_len=request_output_len,
                                            interactive_mode=True, stream=stream, top_k=top_k, top_p=top_p,
                                            temperature=temperature, repetition_penalty=repetition_penalty,
                                            ignore_eos=ignore_eos):
            if out["finish_reason"] == "length" and not out["tokens"]:
                # LMDeploy's notice, printed as there: the session is full and answers every turn with nothing
                print(SESSION_FULL_NOTICE, flush=True)
            elif out["finish_reason"] == "length":
                logger.warning("session %s: the reply hit its length limit (request_output_len, or the "
                               "session is full: then end it)", session_id)
            yield out["text"], out["tokens"], out["finish_reason"]

    def end_session(self, session_id: int) -> None:
        """End the interactive session `session_id` (stopping a running turn), freeing its history and KV
        cache: LMDeploy's empty, non-interactive request with request_output_len=0."""
        for _ in self.chat_interactive_v1(prompt="", session_id=session_id, request_output_len=0,
                                          interactive_mode=False):
            pass

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict, stream: bool, sse: bool) -> Iterator[dict]:
        with self._reaching():
            yield from self._exchange(path, body, stream, sse)

    def _exchange(self, path: str, body: dict, stream: bool, sse: bool) -> Iterator[dict]:
        if not stream:
            yield _json_of(self._check(self._http.post(path, json=body)))
            return
        with self._http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            if _whole_body(resp):  # a server or proxy that answered stream=True with one JSON body
                resp.read()
                yield _raise_if_error(_json_of(resp))
                return
            for line in _lines(resp):
                # SSE: only `data:` lines count. JSON lines: a `data:` prefix is tolerated too (an error line
                # an older lmjax server framed as SSE on /v1/chat/interactive)
                if line.startswith("data:"):
                    line = line[5:].strip()
                    if sse and line == "[DONE]":
                        return
                elif sse:
                    continue
                if line.strip():
                    yield _raise_if_error(_decoded(line, resp.status_code))

    @contextlib.contextmanager
    def _reaching(self):
        with _reaching(self.api_server_url):
            yield

    @staticmethod
    def _check(resp: httpx.Response) -> httpx.Response:
        if resp.status_code >= 400:
            try:
                error = _error_of(resp.json())
            except ValueError:
                error = None
            raise APIClientError(resp.status_code, error[0] if error else resp.text)
        return resp


@contextlib.contextmanager
def _reaching(url: str):
    """httpx's transport errors as the client's: a timeout first (ConnectTimeout is both kinds in httpx)."""
    try:
        yield
    except httpx.TimeoutException as e:
        what = "cannot reach" if isinstance(e, httpx.ConnectTimeout) else "no answer in time from"
        raise APITimeoutError(f"{what} the server at {url} ({type(e).__name__}: {e})") from e
    except _UNREACHABLE as e:
        raise APIConnectionError(f"cannot reach the server at {url}: {e}") from e


def _decoded(text: str, status: int):
    """`text` as JSON; what is not JSON (a proxy's HTML page answered with 200, say) is an APIClientError
    quoting its start, not a JSONDecodeError the caller cannot tell from a bug."""
    try:
        return json.loads(text)
    except ValueError:
        excerpt = text[:200] + ("..." if len(text) > 200 else "")
        raise APIClientError(status, f"the server's answer is not JSON: {excerpt!r}") from None


def _json_of(resp: httpx.Response):
    return _decoded(resp.text, resp.status_code)


def _whole_body(resp: httpx.Response) -> bool:
    """Whether a streamed request's answer is one body rather than lines: its content-type says so (no
    content-type at all is read as lines, the old behaviour)."""
    ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    return bool(ctype) and ctype not in _STREAM_TYPES


def _error_of(body) -> tuple[str, object] | None:
    """(message, code) of an error body: OpenAI's {"error": {"message", "code", ...}} or the flat form of
    LMDeploy's server and vLLM's older one ({"object": "error", "message", "code"}); None for any other body."""
    if not isinstance(body, dict):
        return None
    if "error" in body and "choices" not in body and "text" not in body:
        error = body["error"]
        return (error.get("message", str(body)), error.get("code")) if isinstance(error, dict) else (str(error), None)
    if body.get("object") == "error":
        return body.get("message", str(body)), body.get("code")
    return None


def _raise_if_error(item):
    """An error object inside a 200 (a stream that failed after it started): APIClientError, with the status
    the same request would have got unstreamed when the object carries it."""
    error = _error_of(item)
    if error is None:
        return item
    message, code = error
    raise APIClientError(code if isinstance(code, int) and code >= 400 else 500, message)


# None sent as null: "no limit but the context" (the server's, as vLLM's); dropped it would be the default (16)
_NULL_MEANS_NO_LIMIT = ("max_tokens", "request_output_len")


def _payload(args: dict, extra: dict) -> dict:
    body = {k: v for k, v in args.items()
            if k not in ("self", "kwargs") and (v is not None or k in _NULL_MEANS_NO_LIMIT)}
    body.update(extra)
    return body


def _lines(resp: httpx.Response) -> Iterator[str]:
    """The body's lines, split at LF only (SSE's and JSON lines' separator): httpx's iter_lines also splits at
    U+2028, U+2029 and U+0085, which the server's JSON carries raw inside strings."""
    rest = ""
    for text in resp.iter_text():
        *lines, rest = (rest + text).split("\n")
        yield from (line.removesuffix("\r") for line in lines)
    if rest:
        yield rest


def get_model_list(api_url: str, headers: dict | None = None) -> list[str] | None:
    """LMDeploy's helper: the model ids at `api_url`, the server's /v1/models URL (a bare server URL gets
    /v1/models added); None, logged, when the server answers with an error."""
    url = api_url.rstrip("/")
    url = url if url.endswith("/models") else f"{url}/v1/models"
    with _reaching(api_url):
        response = httpx.get(url, headers=headers)
    if response.status_code >= 400:
        logger.error("failed to get the model list: %s returns %d", url, response.status_code)
        return None
    return [item["id"] for item in response.json().get("data", [])]
