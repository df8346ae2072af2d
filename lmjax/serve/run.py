"""Running the OpenAI app under uvicorn: the listening socket bound before the model loads, and a shutdown that
does not wait on the requests in flight.

The port is taken first (`listen`), as vLLM binds before it builds its engine: a port in use or a host that does
not resolve is a one-line error at once, not after a load and a warm-up of minutes. On SIGTERM or Ctrl-C the
engine closes at once, so every request in flight ends with finish_reason "abort" (its stream closes with that)
and uvicorn, which otherwise waits for open connections to close by themselves, exits: `docker stop` and
systemd's SIGTERM stop a server that is streaming (vLLM likewise aborts what runs). GRACE_S bounds the wait for
the last responses to go out."""
from __future__ import annotations

import socket
import threading

import uvicorn

from lmjax.api.async_engine import AsyncEngine
from lmjax.serve.cors import CorsConfig
from lmjax.serve.openai_server import create_app

GRACE_S = 10  # uvicorn's wait for open connections after the engine closed (their last chunks)
_UVICORN_LEVELS = {"warn": "warning", "fatal": "critical", "notset": "debug"}  # LMDeploy's names uvicorn lacks


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) for the server (uvicorn listens on it); a ValueError naming both when it
    cannot be (in use, a host that does not resolve or is not this machine's)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a restart reuses the port)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(engine: AsyncEngine, server_name: str = "127.0.0.1", server_port: int = 23333,
               api_keys: list[str] | None = None, model_name: str | None = None, log_level: str = "info",
               tool_call_parser: str | None = None, sampling_defaults: dict | None = None,
               model_aliases: tuple[str, ...] = (), cors: CorsConfig | None = CorsConfig(),
               sock: socket.socket | None = None, docs: bool = True, max_tokens_overflow: str = "error") -> None:
    """Serve `engine` until SIGTERM / Ctrl-C (on `sock` when given: `listen`'s), then close it."""
    app = create_app(engine, api_keys, model_name, model_aliases, tool_call_parser, sampling_defaults, cors, docs,
                     max_tokens_overflow)
    level = _UVICORN_LEVELS.get(log_level.lower(), log_level.lower())
    config = uvicorn.Config(app, host=server_name, port=server_port, log_level=level,
                            timeout_keep_alive=30, timeout_graceful_shutdown=GRACE_S)
    server = _Server(config, engine)
    sock = sock or listen(server_name, server_port)
    port = sock.getsockname()[1]  # (the one bound: port 0 picks one)
    print(f"HINT: the api_server answers at http://{server_name}:{port} (OpenAI routes under /v1"
          + (", API docs at /docs)" if docs else ")"), flush=True)  # (as LMDeploy's, at every log level)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()


class _Server(uvicorn.Server):
    """uvicorn's server, closing the engine as soon as a shutdown signal comes (on a thread: the close joins the
    engine thread, and the event loop must go on delivering the aborted requests' last chunks)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            threading.Thread(target=self.engine.close, name="lmjax-close", daemon=True).start()
        super().handle_exit(sig, frame)
