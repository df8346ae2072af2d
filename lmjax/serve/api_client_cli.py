"""`lmjax serve api_client URL` (LMDeploy's `lmdeploy serve api_client`): a terminal chat with one session of
the server's /v1/chat/interactive route. Parsing it imports nothing of the client (httpx is the serve extra's)."""
import argparse
import contextlib


def add_parser(servers) -> None:
    p = servers.add_parser("api_client", allow_abbrev=False, help="chat with a running server in the terminal",
                           description="A terminal chat with URL's /v1/chat/interactive route (LMDeploy's "
                                       "`serve api_client`). End a message with an empty line (double enter); "
                                       "`end` on its own ends the session's conversation on the server and "
                                       "starts a new one, `exit` (or Ctrl-D) ends it and quits.")
    p.add_argument("api_server_url", help="the server's base URL, e.g. http://127.0.0.1:23333")
    p.add_argument("--session-id", type=_session_id, default=0,
                   help="the server session to chat in, 0 or more (default: 0)")
    p.add_argument("--api-key", default=None, help="a bearer key the server accepts")
    p.set_defaults(func=_run)


def _session_id(value: str) -> int:
    """A session id the chat can keep: -1 asks the server for a fresh session each turn (history lost, and
    each left open there), so LMDeploy's chat asserts it away; other negative ids are refused with it."""
    try:
        session_id = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if session_id < 0:
        raise argparse.ArgumentTypeError(f"{session_id} is negative: the chat needs a session id of 0 or more "
                                         "(-1 would start a new server session every turn)")
    return session_id


def _run(args) -> int:
    """The chat; a server that cannot be reached, does not answer in time or refuses (a wrong key, say) is a
    one-line error (rc 2)."""
    url = args.api_server_url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"api_server_url={url!r} must start with http:// or https://")
    # (a timeout is an APIConnectionError too: APITimeoutError)
    from lmjax.serve.client import APIClient, APIClientError, APIConnectionError

    client = APIClient(url, api_key=args.api_key)
    try:
        client.available_models  # noqa: B018  (a server that is not there, or refuses the key: said before input)
        chat_loop(client, args.session_id)
    except (APIClientError, APIConnectionError) as e:
        raise ValueError(str(e)) from None
    finally:
        client.close()
    return 0


def chat_loop(client, session_id: int) -> None:
    """LMDeploy's main loop over `client` (an APIClient): each message is a turn of session `session_id`;
    `end` ends that session on the server (its history and KV cache) and the chat goes on afresh under the
    same id; `exit` or Ctrl-D ends it and quits. A full session's turn prints LMDeploy's notice to end it
    (APIClient.chat's SESSION_FULL_NOTICE) instead of a silent empty reply."""
    from lmjax.serve.client import APIClientError, APIConnectionError

    try:
        while (prompt := _prompt_or_none()) is not None and prompt.strip() != "exit":
            if prompt.strip() == "end":
                client.end_session(session_id)
                print("(session ended: the next message starts a new conversation)")
                continue
            for text, _, _ in client.chat(prompt, session_id, request_output_len=512, stream=True):
                print(text, end="", flush=True)
    finally:
        with contextlib.suppress(APIClientError, APIConnectionError):  # (the server may be what failed)
            client.end_session(session_id)


def _prompt_or_none() -> str | None:
    from lmjax.serve.openai.api_client import input_prompt

    try:
        return input_prompt()
    except EOFError:  # Ctrl-D: the end of the chat, as `exit`
        print()
        return None
