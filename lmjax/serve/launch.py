"""LMDeploy's `serve` and `client` (`lmjax.serve(...)`, `lmjax.client(...)`).

`serve(model_path, ...)` starts `lmjax serve api_server` (python -m lmjax.cli) in a subprocess, waits until
it answers /v1/models, and returns an `APIClient` connected to it, as `lmdeploy.serve` does (lagent's
LMDeployServer calls it). The client's `server_process` attribute is the `ServerProcess` handle:
`.pid`, `.url`, `.running`, `.stop()`. Whatever is still running when the interpreter exits is stopped.

Differences from LMDeploy, on purpose: `server_name` defaults to 127.0.0.1 (the CLI's default: a server
with no API keys is not offered to the network unless asked); start-up gives up after `startup_timeout`
seconds, and a server that exits first raises with the end of its stderr instead of being waited for
forever. Its log goes on to this process's stderr, as LMDeploy's child process shares the console.
A process killed outright (SIGKILL) runs no exit handlers: its server is left running.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from lmjax.cli import build_parser  # argparse only: no JAX
from lmjax.serve.client import APIClient, APIConnectionError

logger = logging.getLogger("lmjax.serve")

# EngineConfig fields whose `lmjax serve api_server` option has another name
_OPTION_NAMES = {"block_size": "cache_block_seq_len"}
_LIVE: set[subprocess.Popen] = set()  # servers started here and not yet stopped (atexit stops them)


def client(api_server_url: str = "http://127.0.0.1:23333", api_key: str | None = None, **kwargs) -> APIClient:
    """LMDeploy's `lmdeploy.client`: an `APIClient` of the server at `api_server_url`."""
    return APIClient(api_server_url, api_key, **kwargs)


def serve(model_path: str, model_name: str | None = None, backend: str | None = "turbomind",
          backend_config=None, chat_template_config=None, server_name: str = "127.0.0.1",
          server_port: int = 23333, log_level: str = "ERROR", api_keys: list[str] | str | None = None,
          ssl: bool = False, *, startup_timeout: float = 600.0, **kwargs) -> APIClient:
    """Start the api_server for `model_path` in a subprocess; returns its APIClient (`server_process` on it).

    backend_config: TurbomindEngineConfig, PytorchEngineConfig or EngineConfig, passed on as the CLI's
    engine options (a field with no option must keep its default). `tp` and any other `lmjax serve
    api_server` option (session_len, tool_call_parser, generation_config, ...) may be given as keywords;
    they override backend_config's fields. max_tokens_overflow is "cut" unless given (LMDeploy's server cuts a
    max_tokens to the room left; `lmjax serve api_server` itself answers vLLM's 400)."""
    if ssl:
        raise NotImplementedError("ssl=True: the lmjax api_server serves plain HTTP only")
    if isinstance(api_keys, str):
        api_keys = [api_keys]
    # LMDeploy's api_server cuts a max_tokens to the room the session leaves (lagent sends 512 whatever the
    # prompt): code calling LMDeploy's launcher expects that, not vLLM's 400 (max_tokens_overflow="error")
    options = {"max_tokens_overflow": "cut", **_engine_options(backend_config, kwargs.pop("tp", None)), **kwargs,
               "model_name": model_name, "backend": backend, "server_name": server_name,
               "server_port": server_port, "log_level": log_level.upper(), "api_keys": api_keys}
    # a wildcard address is reached on loopback from here
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(server_name, server_name)
    url = f"http://[{host}]:{server_port}" if ":" in host else f"http://{host}:{server_port}"
    _check_port_free(host, server_port, url)
    with tempfile.TemporaryDirectory(prefix="lmjax-serve-") as tmp:  # the CLI reads the template at start
        if chat_template_config is not None:
            options["chat_template"] = _write_template(chat_template_config, tmp)
        server = ServerProcess(api_server_argv(model_path, options), url)
        api = APIClient(url, api_keys[0] if api_keys else None)
        try:
            _wait_until_ready(server, api, startup_timeout)
        except BaseException:  # Ctrl-C included: a half-started server must not linger
            server.stop()
            raise
    api.server_process = server
    logger.info("api_server for %s at %s (pid %d); stop it with client.server_process.stop()",
                model_path, url, server.pid)
    return api


def api_server_argv(model_path: str, options: dict) -> list[str]:
    """`serve api_server MODEL --flag value ...` for `options` (option name -> value; None and False leave a
    flag out), checked by the CLI's own parser: an unknown option is a TypeError, a bad value a ValueError."""
    unknown = sorted(name for name in options if name not in _api_server_options())
    if unknown:
        raise TypeError(f"serve() got unexpected keyword arguments {unknown} (not `lmjax serve api_server` options)")
    argv = ["serve", "api_server", model_path]
    for name, value in options.items():
        argv += _flag(name, value)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_parser().parse_args(argv)
    except SystemExit:  # argparse reports to stderr and exits: the message's last line names the problem
        raise ValueError(stderr.getvalue().strip().splitlines()[-1]) from None
    return argv


@functools.cache
def _api_server_options() -> frozenset[str]:
    """The option names of `lmjax serve api_server`, read from the CLI's own parser (its namespace holds
    every option's default), less the positional model and the subcommand bookkeeping."""
    names = vars(build_parser().parse_args(["serve", "api_server"]))
    return frozenset(names) - {"model", "command", "server", "func"}


def _flag(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    if dataclasses.is_dataclass(value):  # SpeculativeConfig: the CLI takes its fields as a JSON object
        value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _engine_options(backend_config, tp: int | None) -> dict:
    """backend_config lowered onto EngineConfig, as the api_server's option names; a field the CLI has no
    option for must be at its default (it could not reach the server)."""
    from lmjax.config import EngineConfig

    if backend_config is None:
        config = EngineConfig(seed=None)  # LMDeploy's server: unseeded requests draw a random seed
    else:
        config = backend_config.to_engine_config() if hasattr(backend_config, "to_engine_config") else backend_config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"backend_config must be TurbomindEngineConfig, PytorchEngineConfig or EngineConfig, "
                            f"got {type(backend_config).__name__}")
    if tp is not None:
        config = dataclasses.replace(config, tp=tp)
    options = {}
    for field in dataclasses.fields(EngineConfig):
        value, name = getattr(config, field.name), _OPTION_NAMES.get(field.name, field.name)
        if name in _api_server_options():
            options[name] = value
        elif value != field.default:
            raise ValueError(f"backend_config: {field.name}={value!r} has no `lmjax serve api_server` option "
                             f"(leave it at {field.default!r})")
    return options


def _write_template(chat_template_config, directory: str) -> str:
    """The CLI's --chat-template file: the config's fields that are set (model_name then falls back to the
    server's --model-name, as in the CLI)."""
    path = os.path.join(directory, "chat_template.json")
    with open(path, "w") as f:
        json.dump({k: v for k, v in dataclasses.asdict(chat_template_config).items() if v is not None}, f)
    return path


def _check_port_free(host: str, port: int, url: str) -> None:
    """A server already answering there would pass for ours: refuse up front (and port 0 cannot be found)."""
    if port == 0:
        raise ValueError("server_port=0: serve() must know the port to connect its client")
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        raise OSError(f"something already listens at {url}: pick another server_port")


def _wait_until_ready(server: ServerProcess, api: APIClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not server.running:
            raise RuntimeError(f"the api_server exited (code {server.process.returncode}) before it answered; "
                               f"its stderr ended with:\n{server.stderr_tail()}")
        with contextlib.suppress(APIConnectionError):
            models = api.available_models  # noqa: F841  (asked for its answer: the server is up)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the api_server did not answer {server.url}/v1/models within {timeout} s; its "
                               f"stderr ended with:\n{server.stderr_tail()}")
        time.sleep(0.25)


class ServerProcess:
    """An api_server subprocess. Its stderr is passed on to ours, and the last lines are kept for errors."""

    def __init__(self, argv: list[str], url: str, tail_lines: int = 40):
        self.url = url
        self.process = subprocess.Popen([sys.executable, "-m", "lmjax.cli", *argv], stderr=subprocess.PIPE)
        self.pid = self.process.pid
        self._tail = collections.deque(maxlen=tail_lines)
        # A reader always drains the pipe: a full one would block the server's next log write
        self._reader = threading.Thread(target=self._forward_stderr, daemon=True)
        self._reader.start()
        _LIVE.add(self.process)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (uvicorn shuts down and the engine closes), SIGKILL after `timeout` s; the exit code."""
        _stop(self.process, timeout)
        _LIVE.discard(self.process)
        return self.process.returncode

    def stderr_tail(self) -> str:
        if not self.running:
            self._reader.join(timeout=5)  # the last lines of a dead server are still in the pipe
        return "".join(self._tail)

    def _forward_stderr(self) -> None:
        for line in self.process.stderr:
            self._tail.append(line.decode(errors="replace"))
            with contextlib.suppress(OSError):
                os.write(2, line)  # fd 2, not sys.stderr: a redirected or closed sys.stderr must not stop this


def _stop(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@atexit.register
def _stop_all() -> None:
    for process in list(_LIVE):
        _stop(process, timeout=10)
