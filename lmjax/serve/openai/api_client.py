"""`lmdeploy.serve.openai.api_client`'s names: lmjax's client (lmjax/serve/client.py) under LMDeploy's path, with
LMDeploy's module functions: `get_streaming_response` (one interactive turn's pieces), `input_prompt` and
`main`, the terminal chat of `lmjax serve api_client URL` (LMDeploy's `lmdeploy serve api_client`)."""
from __future__ import annotations

from collections.abc import Iterator

from lmjax.serve.client import APIClient, APIClientError, APIConnectionError, get_model_list, json_loads

__all__ = ["APIClient", "APIClientError", "APIConnectionError", "get_model_list", "get_streaming_response",
           "input_prompt", "json_loads", "main"]


def get_streaming_response(prompt: str, api_url: str, session_id: int, request_output_len: int = 512,
                           stream: bool = True, interactive_mode: bool = False, ignore_eos: bool = False,
                           cancel: bool = False, top_p: float = 0.8, temperature: float = 0.7,
                           api_key: str | None = None) -> Iterator[tuple[str, int, str | None]]:
    """(text, tokens, finish_reason) of each piece of one /v1/chat/interactive turn; `api_url` is that
    route's URL (LMDeploy's)."""
    base = api_url.removesuffix("/").removesuffix("/v1/chat/interactive")
    client = APIClient(base, api_key=api_key)
    try:
        for item in client.chat_interactive_v1(prompt, session_id, interactive_mode=interactive_mode, stream=stream,
                                               request_output_len=request_output_len, ignore_eos=ignore_eos,
                                               cancel=cancel, top_p=top_p, temperature=temperature):
            yield item.get("text", ""), item.get("tokens", 0), item.get("finish_reason")
    finally:
        client.close()


def input_prompt() -> str:
    """One prompt from the terminal; a line with a double Enter ends it (LMDeploy's)."""
    print("\ndouble enter to end input >>> ", end="")
    return "\n".join(iter(input, ""))


def main(api_server_url: str = "http://0.0.0.0:23333", session_id: int = 0, api_key: str | None = None) -> None:
    """A terminal chat with a server's interactive route, one session: `end` ends its conversation and goes on
    afresh, `exit` (or Ctrl-D) quits (lmjax.serve.api_client_cli.chat_loop, the CLI's loop)."""
    from lmjax.serve.api_client_cli import chat_loop

    if session_id < 0:
        raise ValueError(f"session_id={session_id} is negative: the chat needs a session id of 0 or more")
    client = APIClient(api_server_url, api_key=api_key)
    try:
        client.available_models  # noqa: B018  (a server that is not there, or refuses the key: said before any input)
        chat_loop(client, session_id)
    finally:
        client.close()
