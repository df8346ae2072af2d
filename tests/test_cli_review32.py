"""The command line as LMDeploy and vLLM users drive it (review 32): a server stops on SIGTERM while it streams,
takes its port before it loads the model, says where it answers, takes vLLM's serve flags; the api_client's
errors are one line; a --chat-template's meta_instruction is the system prompt."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import write_tiny_llama
from lmjax import cli
from lmjax.config import ChatTemplateConfig
from server_process import free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _main_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_sigterm_stops_a_server_that_is_streaming(tiny):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmjax.cli", "serve", "api_server", tiny, "--server-port", str(port),
                             "--session-len", "20000", "--api-key", "sk-1", "--log-level", "warn"],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "bearer sk-1"}  # (the scheme in any case)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
            try:
                models = httpx.get(f"{url}/v1/models", headers=auth, timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert models.status_code == 200, models.text
        assert httpx.get(f"{url}/docs", timeout=5).status_code == 200  # Swagger, as vLLM's (LMDeploy: at /)
        body = {"model": models.json()["data"][0]["id"], "prompt": "t5 t6", "max_tokens": 18000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        chunks, finish = 0, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if chunks == 1:
                    proc.send_signal(signal.SIGTERM)
                    stopped = time.monotonic()
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        proc.wait(timeout=30)
        assert time.monotonic() - stopped < 15  # it had ~18,000 tokens to go: the engine closed instead
        assert finish == "abort"
        assert "HINT: the api_server answers at http://127.0.0.1" in proc.stdout.read()  # at --log-level warn too
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_fails_before_the_model_loads(tiny, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_async_engine", lambda *a: pytest.fail("the model loaded first"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        err = _main_error(["serve", "api_server", tiny, "--server-port", str(taken.getsockname()[1])], capsys)
    assert "cannot listen on 127.0.0.1:" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--allow-methods", "--allow-headers", "--api-keys"])
def test_a_list_flag_before_the_model_does_not_swallow_it(tiny, capsys, monkeypatch, flag):
    monkeypatch.setattr(cli, "_async_engine", lambda *a: pytest.fail("the default model would be served"))
    err = _main_error(["serve", "api_server", flag, "GET", tiny, "--server-port", "0"], capsys)
    assert f"{flag} took" in err and "give MODEL before" in err


def test_max_model_len_is_bounded_as_vllm_bounds_it(tiny, capsys, monkeypatch):
    from lmjax.serve import run

    monkeypatch.delenv("LMJAX_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.setattr(run, "run_server", lambda *a, **k: pytest.fail("served a max_model_len past the context"))
    err = _main_error(["serve", "api_server", tiny, "--server-port", "0", "--max-model-len", "100000"], capsys)
    assert "max_model_len=100000" in err and "LMJAX_ALLOW_LONG_MAX_MODEL_LEN" in err
    # LMDeploy's --session-len has no such bound
    args = cli.build_parser().parse_args(["serve", "api_server", tiny, "--session-len", "100000"])
    assert args.session_len == 100000


@pytest.mark.parametrize("level, want", [("warn", "WARN"), ("FATAL", "FATAL"), ("info", "INFO")])
def test_lmdeploys_log_levels_in_any_case(level, want):
    assert cli.build_parser().parse_args(["serve", "api_server", "--log-level", level]).log_level == want


def test_api_client_errors_are_one_line(capsys, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda *a: (_ for _ in ()).throw(EOFError))  # (Ctrl-D, if it asked)
    err = _main_error(["serve", "api_client", f"http://127.0.0.1:{free_port()}"], capsys)
    assert "cannot reach the server" in err and "Traceback" not in err
    err = _main_error(["serve", "api_client", "127.0.0.1:23333"], capsys)
    assert "must start with http://" in err


def test_meta_instruction_is_the_system_prompt_of_the_tokenizers_template(smollm2_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    pirate = ChatTemplateConfig(model_name="smollm2", meta_instruction="You are a pirate.")
    prompt = pirate.messages2prompt(messages, smollm2_tokenizer)
    assert prompt.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>") and "SmolLM" not in prompt
    own = [{"role": "system", "content": "Be brief."}, *messages]  # the messages' own system prompt wins
    assert "pirate" not in pirate.messages2prompt(own, smollm2_tokenizer)
