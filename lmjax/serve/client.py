"""`APIClient`: LMDeploy's Python client of the server (what agent frameworks such as lagent call).

Every endpoint method is a generator, as in LMDeploy: it yields the whole response body once, or with
`stream=True` each chunk (OpenAI SSE chunks, or the interactive endpoint's JSON lines). A non-2xx answer
raises `APIClientError` carrying the status and the server's OpenAI-style error message.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


class APIClientError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class APIClient:
    def __init__(self, api_server_url: str, api_key: str | None = None, timeout: float = 600.0, **kwargs):
        self.api_server_url = api_server_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.api_server_url, headers=headers, timeout=timeout)
        self.chat_completions_v1_url = f"{self.api_server_url}/v1/chat/completions"
        self.completions_v1_url = f"{self.api_server_url}/v1/completions"
        self.chat_interactive_v1_url = f"{self.api_server_url}/v1/chat/interactive"
        self.models_v1_url = f"{self.api_server_url}/v1/models"
        self._models: list[str] | None = None

    @property
    def available_models(self) -> list[str]:
        """Ids of the models the server serves (asked once, then remembered)."""
        if self._models is None:
            body = self._check(self._http.get("/v1/models")).json()
            self._models = [m["id"] for m in body["data"]]
        return self._models

    def chat_completions_v1(self, model: str, messages: str | list[dict], temperature: float = 0.7,
                            top_p: float = 1.0, logprobs: bool = False, top_logprobs: int | None = None, n: int = 1,
                            max_tokens: int | None = None, stop: str | list[str] | None = None,
                            stream: bool = False, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                            user: str | None = None, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, top_k: int = 0, seed: int | None = None,
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
                            request_output_len: int | None = None, top_p: float = 0.8, top_k: int = 40,
                            temperature: float = 0.8, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, cancel: bool = False, seed: int | None = None,
                            **kwargs) -> Iterator[dict]:
        """LMDeploy's session endpoint: `interactive_mode=True` keeps the session's history (and KV cache)
        on the server for the next call with the same `session_id`."""
        body = _payload(locals(), kwargs)
        yield from self._post("/v1/chat/interactive", body, stream, sse=False)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict, stream: bool, sse: bool) -> Iterator[dict]:
        if not stream:
            yield self._check(self._http.post(path, json=body)).json()
            return
        with self._http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if sse:
                    if not line.startswith("data:"):
                        continue
                    line = line[5:].strip()
                    if line == "[DONE]":
                        return
                if line.strip():
                    item = json.loads(line)
                    if "error" in item and "choices" not in item and "text" not in item:
                        raise APIClientError(500, item["error"].get("message", str(item)))
                    yield item

    @staticmethod
    def _check(resp: httpx.Response) -> httpx.Response:
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text
            raise APIClientError(resp.status_code, message)
        return resp


def _payload(args: dict, extra: dict) -> dict:
    body = {k: v for k, v in args.items() if k not in ("self", "kwargs") and v is not None}
    body.update(extra)
    return body


def get_model_list(api_url: str, api_key: str | None = None) -> list[str]:
    """LMDeploy's helper: the model ids served at `api_url`."""
    return APIClient(api_url, api_key).available_models
