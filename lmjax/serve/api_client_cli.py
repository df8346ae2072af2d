"""`lmjax serve api_client URL` (LMDeploy's `lmdeploy serve api_client`): the terminal chat of
lmjax.serve.openai.api_client.main. Parsing it imports nothing of the client (httpx is the serve extra's)."""


def add_parser(servers) -> None:
    p = servers.add_parser("api_client", allow_abbrev=False, help="chat with a running server in the terminal",
                           description="A terminal chat with URL's /v1/chat/interactive route (LMDeploy's "
                                       "`serve api_client`); `exit` on its own ends it.")
    p.add_argument("api_server_url", help="the server's base URL, e.g. http://127.0.0.1:23333")
    p.add_argument("--session-id", type=int, default=0, help="the session to use (default: 0)")
    p.add_argument("--api-key", default=None, help="a bearer key the server accepts")
    p.set_defaults(func=_run)


def _run(args) -> int:
    """The chat; a server that cannot be reached or refuses (a wrong key, say) is a one-line error (rc 2)."""
    url = args.api_server_url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"api_server_url={url!r} must start with http:// or https://")
    from lmjax.serve.client import APIClientError, APIConnectionError
    from lmjax.serve.openai.api_client import main

    try:
        main(url, args.session_id, args.api_key)
    except (APIClientError, APIConnectionError) as e:
        raise ValueError(str(e)) from None
    return 0
