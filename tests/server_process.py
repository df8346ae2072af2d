"""`lmjax serve api_server` as a real process for a test module: started on a free 127.0.0.1 port, waited for
until /health answers, stopped at the end."""
import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def api_server(model: str, *args: str, wait_s: float = 300):
    """Yields the server's base URL (http://127.0.0.1:PORT); `args` are more `api_server` flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "lmjax.cli", "serve", "api_server", model, "--server-port", str(port), *args]
    proc = subprocess.Popen(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + wait_s
        while time.time() < deadline:
            assert proc.poll() is None, f"server exited: {proc.stderr.read()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not become healthy")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
