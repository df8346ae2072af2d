"""`lmjax` command line: argument errors, command dispatch, and `generate` against lmjax.pipeline on the
real SmolLM2 model (greedy, 8 new tokens, so generation costs a few seconds)."""
import os
import subprocess
import sys

import pytest

from lmjax import cli
from lmjax.config import EngineConfig, GenerationConfig

GREEDY_8 = GenerationConfig(max_new_tokens=8, top_k=1, temperature=0.0)


@pytest.fixture(scope="module")
def pipe_calls(smollm2_gguf):
    """Every pipeline(...) the CLI builds, recorded; the real pipeline is built once and shared so the
    module loads the model a single time."""
    from lmjax.api import pipeline as pipeline_module

    calls, real, cached = [], pipeline_module.pipeline, {"closes": 0}

    class Shared:
        """The cached pipeline, left open when the CLI's `with pipeline(...)` ends (the end is counted)."""
        def __getattr__(self, name):
            return getattr(cached["pipe"], name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            cached["closes"] += 1

        def __call__(self, *args, **kwargs):
            return cached["pipe"](*args, **kwargs)

    def spy(model_path=None, backend_config=None, **kwargs):
        calls.append((model_path, backend_config, kwargs))
        if "pipe" not in cached:
            cached["pipe"] = real(model_path, backend_config=backend_config, **kwargs)
        return Shared()

    patch = pytest.MonkeyPatch()
    patch.setattr(pipeline_module, "pipeline", spy)
    yield calls, cached
    patch.undo()


def test_help_lists_every_command():
    script = os.path.join(os.path.dirname(sys.executable), "lmjax")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "lmjax.cli"]
    done = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("generate", "chat", "serve", "convert"):
        assert command in done.stdout


@pytest.mark.parametrize("argv, func", [(["chat"], "_chat"), (["serve", "api_server"], "_serve"),
                                        (["generate", "hi"], "_generate")])
def test_commands_dispatch_without_starting_anything(argv, func):
    assert cli.build_parser().parse_args(argv).func is getattr(cli, func)


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--max-new-tokens", "0", "hi"], "max-new-tokens must be >= 1, got '0'"),
    (["generate", "--top-p", "1.5", "hi"], "top-p must be > 0 and <= 1, got '1.5'"),
    (["generate", "--temperature", "hot", "hi"], "temperature must be a number, got 'hot'"),
    (["generate", "--top-k", "-3", "hi"], "top-k must be >= 0, got '-3'"),
    (["generate", "--dtype", "int8", "hi"], "'int8'"),
    (["generate"], "PROMPT"),
    (["serve"], "SERVER"),
    (["bogus"], "'bogus'"),
    (["serve", "api_server", "m", "--speculative-config", "{ngram"], "not JSON: '{ngram'"),
])
def test_bad_arguments_name_the_value(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_missing_model_is_a_clean_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "api_server", str(tmp_path / "gone")])
    err = capsys.readouterr().err
    assert err.startswith("lmjax serve api_server: error:") and "gone" in err


def test_sampling_flags_reach_generation_config():
    args = cli.build_parser().parse_args(["generate", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9",
                                          "--seed", "3", "--max-new-tokens", "4", "x"])
    params = cli._gen_config(args).to_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.seed, params.max_tokens) == (0.7, 5, 0.9, 3, 4)
    assert not params.is_greedy
    assert cli._gen_config(cli.build_parser().parse_args(["generate", "x"])).to_sampling_params().is_greedy


def test_generate_one_prompt_streams_the_pipeline_text(capsys, pipe_calls):
    calls, cached = pipe_calls
    prompt = "What is the capital of France?"
    closes = cached["closes"]
    assert cli.main(["generate", "--max-new-tokens", "8", prompt]) == 0
    assert cached["closes"] == closes + 1  # the pipeline is closed (Ctrl-C mid-step would abort the process)
    printed = capsys.readouterr().out
    assert calls[-1][:2] == (None, EngineConfig(dtype="auto", session_len=None))
    expected = cached["pipe"](prompt, gen_config=GREEDY_8)
    # 8 tokens, the last EOS, which LMDeploy's generate_token_len does not count
    assert (expected.generate_token_len, expected.finish_reason) == (7, "stop") and expected.text
    assert printed == expected.text + "\n"


def test_generate_many_raw_prompts_prints_each_in_order(capsys, pipe_calls):
    calls, cached = pipe_calls
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert cli.main(["generate", "--no-chat-template", "--max-new-tokens", "8", *prompts]) == 0
    printed = capsys.readouterr().out
    expected = cached["pipe"](prompts, gen_config=GREEDY_8, do_preprocess=False)
    assert printed == "".join(f">>> {p}\n{r.text}\n" for p, r in zip(prompts, expected))


def test_importing_the_cli_loads_no_jax():
    """`lmjax --help` stays instant, and `lmjax convert --tp N` can still give XLA N host devices."""
    code = "import sys, lmjax.cli; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_lmdeploy_engine_flags_reach_the_engine(monkeypatch, tmp_path):
    from lmjax.api import async_engine

    built = {}
    monkeypatch.setattr(async_engine, "AsyncEngine", lambda model, **kw: built.update(model=model, **kw))
    template = tmp_path / "template.json"
    template.write_text('{"meta_instruction": "Be brief.", "user": "U: ", "eoh": "\\n", "assistant": "A: "}')
    args = cli.build_parser().parse_args(
        ["serve", "api_server", "m", "--quant-policy", "8", "--cache-block-seq-len", "32", "--max-prefill-token-num",
         "512", "--rope-scaling-factor", "2", "--chat-template", str(template), "--backend", "turbomind",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    cli._async_engine(args)
    config = built["backend_config"]
    assert (config.quant_policy, config.block_size, config.max_prefill_token_num, config.rope_scaling_factor) == \
        (8, 32, 512, 2.0)
    assert config.speculative_config.num_speculative_tokens == 3
    assert built["chat_template_config"].messages2prompt("Hi") == "Be brief.U: Hi\nA: "
    chat = cli.build_parser().parse_args(["chat", "--repetition-penalty", "1.3", "--quant-policy", "4"])
    assert cli._gen_config(chat).repetition_penalty == 1.3 and chat.quant_policy == 4


@pytest.mark.parametrize("content, fragment", [(None, "not a readable JSON file"), ("[1]", "must hold a JSON object"),
                                               ('{"colour": 1}', "colour")])
def test_a_bad_chat_template_file_is_named(tmp_path, capsys, content, fragment):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        cli.main(["chat", "--chat-template", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and fragment in err


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hi"])
    assert exc.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_chat_sends_non_utf8_input_as_replacement_characters():
    """A byte that is not UTF-8 on stdin (read as a lone surrogate) reached the tokenizer and killed the chat
    with a TypeError; each turn's text is valid UTF-8 now."""
    import asyncio
    import io

    from lmjax.serve.terminal_chat import run_chat

    class Engine:  # the three calls run_chat makes
        model_name, session_len, turns = "fake", 64, []

        async def generate(self, text, session_id, gen_config, **kw):
            self.turns.append(text)
            yield type("Piece", (), {"response": "ok", "finish_reason": "stop", "generate_token_len": 1})

        def end_session(self, session_id):
            future = asyncio.Future(loop=asyncio.new_event_loop())
            future.set_result(None)
            return future

    engine, out = Engine(), io.StringIO()
    # LMDeploy's input: a message is the lines up to an empty one; blank lines before it are skipped
    run_chat(engine, None, io.StringIO("hi\udcff there\nsecond line\n\n\nend\n\n\ud800x\n\nexit"), out)
    assert engine.turns == ["hi\ufffd there\nsecond line", "?x"]
    assert all(t.encode("utf-8") for t in engine.turns) and out.getvalue().count("ok") == 2


@pytest.mark.parametrize("model", [None, "smollm2", "GGUF"])
def test_the_default_model_answers_to_its_ids_however_it_was_named(monkeypatch, smollm2_gguf, model):
    from lmjax.serve import openai_server, run

    served = {}
    monkeypatch.setattr(cli, "_async_engine", lambda args, level: "engine")
    monkeypatch.setattr(run, "listen", lambda host, port: None)
    monkeypatch.setattr(run, "run_server", lambda *a, **_: served.update(aliases=a[-1]))
    argv = ["serve", "api_server"] + ([] if model is None else [smollm2_gguf if model == "GGUF" else model])
    assert cli.main(argv) == 0
    names = openai_server.accepted_names("SmolLM2-135M-Instruct.Q4_1", served["aliases"])
    assert {"HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "smollm2"} <= names


def test_chat_and_generate_import_without_the_serve_extra():
    """`lmjax chat` imported lmjax.serve, whose package init imported the client's httpx: without the `serve`
    extra it died with ModuleNotFoundError. Now the client loads on first use."""
    code = ("import sys\n"
            "for m in ('httpx', 'fastapi', 'uvicorn'): sys.modules[m] = None  # as if not installed\n"
            "import lmjax.cli, lmjax.serve.terminal_chat, lmjax.api.async_engine\n"
            "import lmjax.serve\n"
            "try:\n    lmjax.serve.APIClient\nexcept ImportError:\n    print('client needs httpx')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "client needs httpx"


@pytest.mark.parametrize("flags, warmup", [([], None), (["--warmup"], True), (["--no-enforce-eager"], True),
                                           (["--enforce-eager"], False), (["--warmup", "--enforce-eager"], False)])
def test_warmup_flags_reach_the_engine(monkeypatch, flags, warmup):
    """`--warmup` (vLLM: `--no-enforce-eager`) compiles at start-up what serving would compile in its middle; the
    server does by default on a GPU (as vLLM's), `lmjax chat` only when asked."""
    import jax

    from lmjax.api import async_engine

    built = {}
    monkeypatch.setattr(async_engine, "AsyncEngine", lambda model, **kw: built.update(model=model, **kw))
    for command in (["chat"], ["serve", "api_server", "m"]):
        args = cli.build_parser().parse_args([*command, *flags])
        assert args.warmup is warmup
        cli._async_engine(args)
        assert built["backend_config"].warmup is bool(warmup)
    for backend, auto in (("cpu", False), ("gpu", True)):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        assert cli.serve_warmup(warmup) is (auto if warmup is None else warmup)
