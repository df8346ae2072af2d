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
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_profile import StepProfile, profile_decode  # noqa: E402
from hf_baseline import _hf_batch, hf_compiled, hf_pad_id, load_hf, run_bounded  # noqa: E402
from random_model import SHAPES, ensure_checkpoint  # noqa: E402


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclasses.dataclass
class Result:
    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    extra: dict = dataclasses.field(default_factory=dict)

    def rates(self) -> dict:
        t = self.elapsed_s
        return {"requests_per_s": self.num_requests / t, "output_tokens_per_s": self.output_tokens / t,
                "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / t}


# ------------------------------------------------------------------ workload
def make_workload(tokenizer, vocab_size: int, num: int, in_range, out_range, seed: int) -> list[Request]:
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = [i for i in range(min(vocab_size, len(tokenizer))) if i not in special]
    return [Request([rng.choice(pool) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
            for _ in range(num)]


def model_path(args) -> str:
    if args.shape:
        # Random weights of a named shape (written once under the temp dir, torch on the GPU if any);
        # both engines read the same files.
        return ensure_checkpoint(args.shape, args.dtype, args.checkpoint_root, args.seed)[0]
    from lmjax.loader.resolve import resolve_model_path

    return resolve_model_path(args.model)


# ------------------------------------------------------------------ compile-time accounting
class CompileClock:
    """Sums JAX's own trace/lower/compile durations (jax.monitoring), so compile time is separable."""

    def __init__(self):
        from jax import monitoring

        self.seconds, self.count = 0.0, 0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration
            self.count += event.endswith("backend_compile_duration")

    def snapshot(self) -> tuple[float, int]:
        return self.seconds, self.count


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
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    # enforce_eager=False: every decode batch bucket compiles at start-up (untimed, reported as load
    # compilations), as vLLM captures its CUDA graphs before a benchmark starts.
    llm = LLM(path, dtype=args.dtype, max_model_len=args.max_model_len or longest,
              enforce_eager=args.enforce_eager or False, **kwargs)
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


def _check_counts(name: str, tokens: list[list[int]], requests: list[Request]) -> None:
    wrong = [(len(t), r.max_tokens) for t, r in zip(tokens, requests) if len(t) != r.max_tokens]
    if wrong:
        raise RuntimeError(f"{name} generated the wrong number of tokens (got, wanted): {wrong[:5]}")


def _prompt_tokens(requests) -> int:
    return sum(len(r.prompt_ids) for r in requests)


def _budget(requests) -> int:
    return sum(r.max_tokens for r in requests)


# ------------------------------------------------------------------ transformers
def _timed_groups(groups: list[list[int]], max_requests: int) -> list[list[int]]:
    """All batches, or (max_requests > 0) about max_requests' worth of whole batches spread evenly over the
    full-size ones (a smaller last batch is another shape: with --hf-compile it would compile in the clock)."""
    n = min(len(groups), max(1, max_requests // len(groups[0]))) if max_requests else len(groups)
    if n >= len(groups):
        return groups
    full = [g for g in groups if len(g) == len(groups[0])]
    n = min(n, len(full))
    return [full[round(i * (len(full) - 1) / max(n - 1, 1))] for i in range(n)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int, static: bool = False,
           max_requests: int = 0) -> tuple[Result, list[list[int] | None]]:
    order = sorted(range(len(requests)), key=lambda i: requests[i].max_tokens)
    groups = _timed_groups([order[s:s + batch_size] for s in range(0, len(order), batch_size)], max_requests)
    if static:  # compiles this batch size's shapes (and records its CUDA graphs) before the clock starts
        first = groups[0]
        _hf_batch(model, [requests[i].prompt_ids for i in first], max(requests[i].max_tokens for i in first),
                  pad_id, static=True)
    else:
        _hf_batch(model, [r.prompt_ids for r in requests[:2]], 4, pad_id)  # warm-up: one small batch
    tokens: list[list[int] | None] = [None] * len(requests)
    discarded = padded = 0
    start = time.perf_counter()
    for group in groups:
        budget = max(requests[i].max_tokens for i in group)
        out, pads = _hf_batch(model, [requests[i].prompt_ids for i in group], budget, pad_id, static=static)
        for i, ids in zip(group, out):
            tokens[i] = ids[:requests[i].max_tokens]  # count only what the request asked for
            discarded += budget - requests[i].max_tokens
        padded += pads
    elapsed = time.perf_counter() - start
    timed = [i for g in groups for i in g]
    _check_counts("transformers", [tokens[i] for i in timed], [requests[i] for i in timed])
    extra = {"hf_batch_size": batch_size, "hf_static_cache": static, "hf_compiled": static and hf_compiled(model),
             "hf_discarded_tokens": discarded, "hf_pad_tokens": padded}
    if len(timed) < len(requests):  # extrapolate by output tokens: the rates of the timed batches
        timed_out = sum(requests[i].max_tokens for i in timed)
        extra.update({"hf_extrapolated_from_requests": len(timed), "hf_timed_s": round(elapsed, 3)})
        elapsed *= _budget(requests) / timed_out
    return Result("transformers", elapsed, len(requests), _prompt_tokens(requests), _budget(requests), extra), tokens


def best_hf(path: str, requests: list[Request], args) -> tuple[Result, list[list[int] | None]] | None:
    """Every --hf-batch-size in this process (each result also appended to --hf-result as it finishes);
    the fastest is the baseline."""
    import torch

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_hf(path, args.dtype, device)
    pad_id = hf_pad_id(model)
    runs = []
    for bs in args.hf_batch_size:
        run = _run_hf_guarded(model, requests, bs, pad_id, args)
        res = run[0]
        print(f"transformers batch {bs}{' static+compile' if res.extra['hf_compiled'] else ''}: {res.elapsed_s:.2f} s"
              f"{' (extrapolated)' if 'hf_timed_s' in res.extra else ''}, "
              f"{res.rates()['output_tokens_per_s']:.2f} out tok/s", file=sys.stderr, flush=True)
        if args.hf_result:
            with open(args.hf_result, "a") as f:
                f.write(json.dumps({"result": dataclasses.asdict(res), "tokens": run[1]}) + "\n")
        runs.append(run)
    return min(runs, key=lambda run: run[0].elapsed_s) if runs else None


def _run_hf_guarded(model, requests, bs: int, pad_id: int, args):
    """--hf-compile where it works; a failure is recorded and the batch size rerun eager."""
    if not args.hf_compile:
        return run_hf(model, requests, bs, pad_id, max_requests=args.hf_max_requests)
    try:
        return run_hf(model, requests, bs, pad_id, static=True, max_requests=args.hf_max_requests)
    except Exception as e:  # noqa: BLE001 - torch.compile / StaticCache failures vary by version
        message = f"{type(e).__name__}: {str(e).strip()[-300:]}"
        print(f"transformers batch {bs}: static+compile failed ({message}); eager instead", file=sys.stderr)
        res, tokens = run_hf(model, requests, bs, pad_id, max_requests=args.hf_max_requests)
        res.extra["hf_compile_error"] = message
        return res, tokens


def hf_in_subprocess(argv: list[str], args) -> tuple[Result, list[list[int] | None]] | None:
    """Run this script's transformers side in a child (--skip-lmjax --hf-result FILE) under --hf-timeout;
    returns the fastest batch size it finished, or None."""
    fd, result_file = tempfile.mkstemp(prefix="lmjax-throughput-hf-", suffix=".jsonl")
    os.close(fd)
    child = [a for a in argv if a != "--hf-subprocess"]
    cmd = [sys.executable, os.path.abspath(__file__), *child, "--skip-lmjax", "--hf-result", result_file]
    code, _ = run_bounded(cmd, args.hf_timeout, stdout=subprocess.DEVNULL)
    status = f"timed out after {args.hf_timeout} s" if code is None else "ok" if code == 0 else f"exit code {code}"
    with open(result_file) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    os.unlink(result_file)
    print(f"transformers child: {status}, {len(runs)} of {len(args.hf_batch_size)} batch sizes measured",
          file=sys.stderr)
    if not runs:
        return None
    best = min(runs, key=lambda r: r["result"]["elapsed_s"])
    res = Result(**best["result"])
    res.extra.update({"hf_child_status": status, "hf_all_batch_sizes": {
        r["result"]["extra"]["hf_batch_size"]: round(Result(**r["result"]).rates()["output_tokens_per_s"], 1)
        for r in runs}})
    return res, best["tokens"]


# ------------------------------------------------------------------ report
def agreement(a: list[list[int]], b: list[list[int] | None]) -> dict:
    """Greedy sanity check: same weights, same prompts -> mostly the same tokens (ties may differ).
    Only requests both engines ran (transformers may have timed a subset)."""
    pairs = [(x, y) for x, y in zip(a, b) if y is not None]
    if not pairs:
        return {"identical_outputs": "0/0", "mean_common_prefix": None}
    same = sum(x == y for x, y in pairs)
    prefix = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / max(len(x), 1) for x, y in pairs]
    return {"identical_outputs": f"{same}/{len(pairs)}", "mean_common_prefix": round(sum(prefix) / len(prefix), 3)}


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<14}{'elapsed s':>11}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}  note")
    for r in results:
        x = r.rates()
        print(f"{r.name:<14}{r.elapsed_s:>11.2f}{x['requests_per_s']:>9.3f}{x['output_tokens_per_s']:>12.2f}"
              f"{x['total_tokens_per_s']:>13.2f}  {_note(r)}")


def _note(r: Result) -> str:
    e = r.extra
    if r.name == "lmjax":
        return (f"warm-up {e['warmup_s']:.1f} s ({e['warmup_compilations']} compiles); in timed pass "
                f"{e['compilations_in_timed_pass']} compiles, {e['compile_s_in_timed_pass']:.1f} s")
    note = f"batch {e['hf_batch_size']}, " + ("static+compile" if e.get("hf_compiled") else
                                               "static cache, not compiled" if e.get("hf_static_cache") else "eager")
    if "hf_extrapolated_from_requests" in e:
        note += f", extrapolated from {e['hf_extrapolated_from_requests']} requests ({e['hf_timed_s']:.1f} s)"
    if "hf_compile_error" in e:
        note += f", compile failed: {e['hf_compile_error'][:80]}"
    if "hf_all_batch_sizes" in e:
        note += f"; out tok/s by batch size {e['hf_all_batch_sizes']}"
    return note


def print_profile(p: dict) -> None:
    if "error" in p:
        print(f"profile: {p['error']}")
        return
    wall, span, busy = p["wall_ms_per_step"], p["span_us_per_step"] / 1e3, p["busy_us_per_step"] / 1e3
    print(f"profile (batch {p['batch']}, {p['decode_steps']} decode steps traced): wall {wall:.3f} ms/step, GPU span "
          f"{span:.3f} ms, busy {busy:.3f} ms -> device idle {100 * p['idle_fraction']:.1f}% of the span "
          f"({100 * (1 - busy / wall):.1f}% of the wall time)")
    for name, us, n in p["top_kernels_us_per_step"][:5]:
        print(f"  {us:9.1f} us/step {n:6.1f}x  {name[:70]}")


def summary(args, path, requests, results, agree) -> dict:
    out = {"model": args.shape or path, "dtype": args.dtype, "num_prompts": len(requests),
           "prompt_tokens": _prompt_tokens(requests), "output_tokens": _budget(requests),
           "threads": args.threads, "loadavg": os.getloadavg()}
    for r in results:
        out[r.name] = {"elapsed_s": round(r.elapsed_s, 3), **{k: round(v, 3) for k, v in r.rates().items()},
                       **r.extra}
    if "lmjax" in out and "transformers" in out:
        out["output_tps_ratio"] = round(out["lmjax"]["output_tokens_per_s"]
                                        / out["transformers"]["output_tokens_per_s"], 3)
        out["agreement"] = agree
    return out


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
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="LLM(max_num_batched_tokens=...)")
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
