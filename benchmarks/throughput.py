"""Offline throughput: lmjax's `LLM.generate` against transformers' batched `generate` on the same prompts.

    python benchmarks/throughput.py --num-prompts 64                    # SmolLM2-135M-Instruct GGUF, float32
    python benchmarks/throughput.py --shape llama-3.2-1b --dtype bfloat16
    python benchmarks/throughput.py --model /path/to/hf_dir_or.gguf --hf-batch-size 16 64

GPU (issue 9's workload: 1,000 requests of 128 prompt + 128 new tokens, random bf16 weights of a shape):

    python benchmarks/throughput.py --shape llama-3.2-1b --dtype bfloat16 --num-prompts 1000 --input-len 128 \
        --output-len 128 --hf-batch-size 64 128 256 --hf-compile --hf-max-requests 256 --hf-subprocess \
        --warmup-prompts 256 --warmup-tokens 0 --profile DIR --json-out DIR/throughput.jsonl

Workload (seeded): `--num-prompts` prompts of random token ids (special tokens excluded, no BOS added) with
lengths uniform in `--input-len` and per-request output budgets uniform in `--output-len`. Both sides decode
greedily and generate exactly the budget: lmjax with `ignore_eos=True`, transformers with
`min_new_tokens = max_new_tokens`.

Metrics (vLLM's): requests/s, output tokens/s, total tokens/s = (prompt + output tokens) / elapsed, where
prompt tokens are the real prompt lengths and output tokens are the sum of the budgets each request asked
for, on both sides. transformers' `generate` takes one max_new_tokens per call, so its requests are sorted
by budget and cut into batches of `--hf-batch-size`; each batch runs to its largest budget, and the extra
tokens the shorter requests generate (and the left padding) are work it does but are NOT counted; they are
reported as `hf_discarded_tokens` / `hf_pad_tokens`. Several `--hf-batch-size` values: each is measured and
the fastest is the baseline.

Warm-up: lmjax runs the same prompts (the first `--warmup-prompts`, default all) once with budgets capped at
`--warmup-tokens` (0: the full budgets; this compiles the prefill and decode buckets; its compile time is
reported separately), then the timed pass runs. Compilations still happening in the timed pass are counted
and timed (`compile_s_in_timed_pass`): they are part of the timed pass. transformers warms up on one small
batch (with `--hf-compile`: one full batch of each batch size, which compiles it). Model loading is never timed.

transformers on a GPU:
- `--hf-compile`: StaticCache (`cache_implementation="static"`), with which `generate` torch.compiles the decode
  step on CUDA (CUDA graphs). A batch size where that fails is reported (`hf_compile_error`) and rerun eager.
  Compilation wants one shape per batch: use fixed lengths (`--input-len 128 --output-len 128`).
- `--hf-max-requests N`: time only N requests per batch size (whole batches, spread evenly over the sorted
  workload) and extrapolate: elapsed = timed seconds x all output tokens / timed output tokens. Exact for
  fixed lengths up to the last, partial batch; reported as `hf_extrapolated_from_requests`.
- `--hf-subprocess`: transformers runs first, in a child process bounded by `--hf-timeout` seconds, so torch
  and JAX never hold the GPU's memory together; batch sizes finished before a timeout still count.
`--profile DIR`: after the timed pass, a batch of `--profile-batch` decoding requests is traced for a few
engine calls (jax.profiler) and summarized by benchmarks/trace_summary.py: GPU busy time vs span, so the
device's idle time between decode steps (host gaps) is idle = span - busy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The transformers side, the report and the workload records live in throughput_hf.py,
# throughput_report.py and throughput_workload.py; this script runs lmjax and both sides in turn.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_clock import CompileClock  # noqa: E402
from engine_profile import StepProfile, profile_decode  # noqa: E402
from random_model import SHAPES, ensure_checkpoint  # noqa: E402
from throughput_hf import _run_hf_guarded, _timed_groups, best_hf, hf_in_subprocess, run_hf  # noqa: E402
from throughput_report import _note, agreement, print_profile, print_table, summary  # noqa: E402
from throughput_workload import (  # noqa: E402
    Request,
    Result,
    _budget,
    _check_counts,
    _prompt_tokens,
    make_workload,
)

__all__ = [  # the script's own names and, re-exported, those of the modules it was split into
    "main", "parse_args", "set_threads", "model_path", "CompileClock", "run_lmjax", "Request", "Result",
    "make_workload", "_check_counts", "_prompt_tokens", "_budget", "_timed_groups", "run_hf", "best_hf",
    "_run_hf_guarded", "hf_in_subprocess", "agreement", "print_table", "_note", "print_profile", "summary",
]


# ------------------------------------------------------------------ the model both engines load
def model_path(args) -> str:
    if args.shape:
        # Random weights of a named shape (written once under the temp dir, torch on the GPU if any);
        # both engines read the same files.
        return ensure_checkpoint(args.shape, args.dtype, args.checkpoint_root, args.seed)[0]
    from lmjax.loader.resolve import resolve_model_path

    return resolve_model_path(args.model)


# ------------------------------------------------------------------ lmjax
def _lmjax_generate(llm, requests, cap: int | None = None):
    from lmjax import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=min(r.max_tokens, cap or r.max_tokens), ignore_eos=True)
              for r in requests]
    return llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)


def run_lmjax(path: str, requests: list[Request], args) -> tuple[Result, list[list[int]]]:
    from lmjax import LLM

    clock = CompileClock()
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    kwargs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens),
                                ("kv_cache_dtype", args.kv_cache_dtype)) if v}
    # enforce_eager=False: every decode batch bucket compiles at start-up (untimed, reported as load
    # compilations), as vLLM captures its CUDA graphs before a benchmark starts.
    # prefix caching only when asked: the warm-up pass sends the same prompts, which the cache would then serve
    llm = LLM(path, dtype=args.dtype, max_model_len=args.max_model_len or longest,
              enforce_eager=args.enforce_eager or False, enable_prefix_caching=args.enable_prefix_caching, **kwargs)
    load_compile_s, load_n = clock.snapshot()
    start = time.perf_counter()
    _lmjax_generate(llm, requests[:args.warmup_prompts or None], cap=args.warmup_tokens or None)
    warm_s, (warm_compile_s, warm_n) = time.perf_counter() - start, clock.snapshot()
    profile = StepProfile(llm.llm_engine, clock) if args.breakdown else None
    start = time.perf_counter()
    outputs = _lmjax_generate(llm, requests)
    elapsed = time.perf_counter() - start
    compile_s, compile_n = clock.snapshot()
    tokens = [o.outputs[0].token_ids for o in outputs]
    _check_counts("lmjax", tokens, requests)
    extra = {"startup_compile_s": load_compile_s, "startup_compilations": load_n,
             "warmup_s": warm_s, "warmup_compile_s": warm_compile_s - load_compile_s,
             "warmup_compilations": warm_n - load_n,
             "compile_s_in_timed_pass": compile_s - warm_compile_s, "compilations_in_timed_pass": compile_n - warm_n,
             "preemptions": llm.llm_engine.scheduler.num_preemptions}
    if profile:
        extra["breakdown"] = profile.report(elapsed)
    if args.profile:
        extra["device_profile"] = profile_decode(llm, requests, args)
    return Result("lmjax", elapsed, len(requests), _prompt_tokens(requests), _budget(requests), extra), tokens


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random-weight Llama of this shape")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs="+", default=(8, 512), metavar="N",
                   help="MIN MAX prompt tokens (one value: exactly that many)")
    p.add_argument("--output-len", type=int, nargs="+", default=(16, 256), metavar="N",
                   help="MIN MAX new tokens (one value: exactly that many)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="LLM(max_model_len=...) (default: the longest request; multi-step decode wants "
                        "num_scheduler_steps tokens of room, else a request's last steps run one by one)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="LLM(enforce_eager=True): no start-up compilation of the decode buckets")
    p.add_argument("--max-num-seqs", type=int, default=None, help="LLM(max_num_seqs=...) (default: LLM's)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="LLM(enable_prefix_caching=True) (off here: the warm-up pass repeats the timed prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="LLM(max_num_batched_tokens=...)")
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "int8", "int4"),
                   help="LLM(kv_cache_dtype=...): int8 / int4 quantize the KV cache (quant_policy 8 / 4)")
    p.add_argument("--warmup-tokens", type=int, default=4,
                   help="lmjax warm-up pass: budget cap per request (0: the full budgets)")
    p.add_argument("--warmup-prompts", type=int, default=0, help="lmjax warm-up pass: the first N prompts (0: all)")
    p.add_argument("--checkpoint-root", default=None, help="where --shape checkpoints are written (default: temp dir)")
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[16],
                   help="transformers batch size(s); with several, the fastest is the baseline")
    p.add_argument("--hf-device", default=None, help="torch device for the baseline (default: cuda if available)")
    p.add_argument("--hf-compile", action="store_true",
                   help="transformers with StaticCache (+ torch.compile of the decode step on CUDA)")
    p.add_argument("--hf-max-requests", type=int, default=0,
                   help="time only about this many requests per batch size and extrapolate (0: all)")
    p.add_argument("--hf-subprocess", action="store_true",
                   help="run transformers first in a child process (GPU: no memory shared with JAX)")
    p.add_argument("--hf-timeout", type=float, default=300, help="seconds for the --hf-subprocess child")
    p.add_argument("--hf-result", default=None, help=argparse.SUPPRESS)  # the child's output file
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for both XLA and torch (0: library defaults); 1 avoids thread "
                        "oversubscription on a shared machine")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-lmjax", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time each part of lmjax's engine step")
    p.add_argument("--json-out", help="append the JSON summary line to this file")
    p.add_argument("--profile", default=None, help="trace a batch of decode steps into this directory (GPU idle)")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--profile-calls", type=int, default=4, help="engine step() calls traced")
    args = p.parse_args(argv)
    for name in ("input_len", "output_len"):
        value = getattr(args, name)
        if len(value) not in (1, 2):
            p.error(f"--{name.replace('_', '-')} takes MIN MAX or one value, got {value}")
        setattr(args, name, (value[0], value[-1]))
    return args


def set_threads(n: int) -> None:
    """Must run before jax is imported: XLA reads its flags once."""
    if n <= 0:
        return
    # XLA:CPU runs some work on its own thread pools whatever its flags say (plain matmuls measured at
    # 1.8 cores with multi_thread_eigen off): pin the process to n cores so both engines get the same.
    cores = sorted(os.sched_getaffinity(0))[:n]
    os.sched_setaffinity(0, cores)
    flag = "--xla_cpu_multi_thread_eigen=false" if n == 1 else ""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag} intra_op_parallelism_threads={n}"
    import torch

    torch.set_num_threads(n)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    set_threads(args.threads)
    path = model_path(args)
    from lmjax.loader.tokenizer import load_tokenizer
    from lmjax.loader.safetensors_loader import read_config

    tokenizer = load_tokenizer(path)
    vocab = read_config(path)["vocab_size"] if os.path.isdir(path) else len(tokenizer)
    requests = make_workload(tokenizer, vocab, args.num_prompts, args.input_len, args.output_len, args.seed)
    if args.hf_result:  # the --hf-subprocess child: its results went to that file
        best_hf(path, requests, args)
        return {}
    results, outputs, hf = [], {}, None
    if not args.skip_hf and args.hf_subprocess:  # first: the child frees the GPU before JAX takes it
        hf = hf_in_subprocess(argv, args)
    if not args.skip_lmjax:
        res, outputs["lmjax"] = run_lmjax(path, requests, args)
        results.append(res)
    if not args.skip_hf and not args.hf_subprocess:  # in this process, after lmjax (as the CPU runs did)
        hf = best_hf(path, requests, args)
    if hf is not None:
        results.append(hf[0])
        outputs["transformers"] = hf[1]
    agree = agreement(outputs["lmjax"], outputs["transformers"]) if len(outputs) == 2 else None
    print_table(results)
    out = summary(args, path, requests, results, agree)
    if "output_tps_ratio" in out:
        print(f"lmjax / transformers output tok/s: {out['output_tps_ratio']:.2f}x; greedy agreement {agree}")
    if "device_profile" in out.get("lmjax", {}):
        print_profile(out["lmjax"]["device_profile"])
    line = json.dumps(out)
    print(line)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return out


if __name__ == "__main__":
    main()
