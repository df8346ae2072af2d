"""Batch-1 latency: decode step time and time to first token of lmjax's engine, against transformers on the
same device and the same weights, with the bandwidth roofline.

    python benchmarks/latency.py --shape llama-3.2-1b --out DIR          # GPU: random bf16 weights of the shape
    python benchmarks/latency.py --shape tiny --hf-modes eager --out DIR # CPU smoke run
    python benchmarks/latency.py --model /path/to/hf_dir --out DIR
    python benchmarks/latency.py --shape llama-3.2-1b --start-only       # engine start only (compile cache check)

One request of `--prompt-len` random token ids generating exactly `--new-tokens` (greedy, ignore_eos), through
lmjax's real path: `LLM(...)` and its engine's `step()` loop (what `LLM.generate` runs), multi-step decode
at the engine's default `num_scheduler_steps`. Measured per request:
- TTFT: from `add_request` to the return of the step that produced the first token (the prefill).
- decode: from there to the last token. step ms = decode time / decode steps the device ran (each
  multi-step call runs K steps, the last one may run past max_tokens); tok ms = decode time / (new - 1)
  tokens delivered. p10/p90 are over the engine calls (per-step time of each call) of all repeats.
The first request (cold: it compiles every bucket, or loads them from the persistent compilation cache)
is reported on its own as the engine start; `--repeats` warm requests follow.

transformers (AutoModelForCausalLM from the same checkpoint, same dtype) runs in a child process first, so
JAX and torch never hold the GPU's memory at the same time, under `--hf-timeout`. Modes (`--hf-modes`):
"eager" (dynamic cache) and "compile" (static cache; on CUDA `generate` then torch.compiles the decode step
with CUDA graphs by itself). TTFT = median time of `generate(max_new_tokens=1)`; step ms = (time of
`generate(max_new_tokens=new)` - TTFT) / (new - 1); p10/p90 over the repeats. A failing mode is reported with
its error and the eager numbers stand as the baseline.

Roofline: parameter bytes (from the checkpoint's safetensors headers, in `--dtype`) / `--bandwidth` (copy
bandwidth, default 4.26e12 B/s, an H200; `--bandwidth measure` measures this device's copy rate in the same
run, after transformers has freed the GPU and before lmjax starts): the batch-1 step can not be faster than
reading every weight once.
Output: a compact table on stdout; the full record as JSON in `--out` (latency-<name>.json) if given.
"""
from __future__ import annotations

import time

SCRIPT_START = time.perf_counter()  # "time to first token since the process started" counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_clock import CompileClock  # noqa: E402
from random_model import SHAPES, checkpoint_bytes, ensure_checkpoint  # noqa: E402
from hf_baseline import run_bounded  # noqa: E402

H200_COPY_BANDWIDTH = 4.26e12
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------ shared
def fixed_prompt(model_dir: str, length: int, seed: int) -> list[int]:
    """Random ids above the special ones (0-2 in random_model's tokenizer), the same in both processes."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def percentiles(samples_ms: list[float]) -> dict:
    s = sorted(samples_ms)
    if not s:
        return {}
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median": round(statistics.median(s), 4), "p10": round(pick(0.1), 4), "p90": round(pick(0.9), 4)}


def roofline(model_dir: str, dtype: str, bandwidth: float) -> dict:
    """Issue 9's roofline, every weight's bytes / the copy rate; and the bytes a step reads: an untied input
    embedding apart (a step gathers one row of it; a tied one is read whole as the lm_head)."""
    nbytes = checkpoint_bytes(model_dir, ITEMSIZE[dtype])
    untied = checkpoint_bytes(model_dir, ITEMSIZE[dtype], only="model.embed_tokens.weight") \
        if checkpoint_bytes(model_dir, ITEMSIZE[dtype], only="lm_head.weight") else 0
    return {"param_bytes": nbytes, "bandwidth": bandwidth, "step_ms": 1e3 * nbytes / bandwidth,
            "tokens_per_s": bandwidth / nbytes, "read_bytes": nbytes - untied,
            "read_step_ms": 1e3 * (nbytes - untied) / bandwidth}


# ------------------------------------------------------------------ lmjax
def time_request(engine, prompt: list[int], new_tokens: int) -> dict:
    """One request through engine.step(); per call: seconds, tokens delivered, device steps run."""
    from lmjax import SamplingParams

    t0 = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    comp, calls, last, first_token_at = req.completions[0], [], t0, None
    while not req.finished:
        steps_read, had = engine.num_loop_steps_read, len(comp.token_ids)
        engine.step()
        now = time.perf_counter()
        if first_token_at is None and comp.token_ids:
            first_token_at = now  # the prefill step sampled the first token
        elif had:  # a decode call: the K steps of the multi-step loop it read (the last one's tail
            # past max_tokens included: the device ran them), else one step
            calls.append((now - last, len(comp.token_ids) - had, engine.num_loop_steps_read - steps_read or 1))
        last = now
    if len(comp.token_ids) != new_tokens:
        raise RuntimeError(f"lmjax generated {len(comp.token_ids)} tokens, wanted {new_tokens}")
    decode_s = last - first_token_at
    steps = sum(c[2] for c in calls)
    return {"ttft_s": first_token_at - t0, "total_s": last - t0, "decode_s": decode_s,
            "decode_steps": steps, "decode_calls": len(calls), "step_ms": 1e3 * decode_s / max(steps, 1),
            "tok_ms": 1e3 * decode_s / max(new_tokens - 1, 1),
            "call_step_ms": [1e3 * dt / n for dt, _, n in calls], "call_tokens": [t for _, t, _ in calls],
            "call_steps": [n for _, _, n in calls], "tokens": list(comp.token_ids)}


def run_lmjax(path: str, prompt: list[int], args) -> dict:
    """Engine start (load + the first, cold request) and then `--repeats` warm requests."""
    import jax

    from lmjax import LLM
    from lmjax.engine import compile_cache

    clock = CompileClock()
    t0 = time.perf_counter()
    # no prefix caching (LLM's default is on): the repeats send the same prompt, and TTFT is to measure prefill
    llm = LLM(path, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 64, enable_prefix_caching=False)
    engine = llm.llm_engine
    load_s = time.perf_counter() - t0
    cold = time_request(engine, prompt, args.new_tokens)
    start = {"load_s": load_s, "first_request_s": cold["total_s"], "first_ttft_s": cold["ttft_s"],
             "start_to_first_token_s": load_s + cold["ttft_s"],
             "script_start_to_first_token_s": t0 + load_s + cold["ttft_s"] - SCRIPT_START,
             "load_phases_s": engine.load_seconds,
             "step_traces": engine.runner.num_compilations, "compile_s": clock.seconds,
             **compile_cache.compile_stats()}
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "num_scheduler_steps": engine.config.num_scheduler_steps, "start": start}
    if args.start_only:
        return out
    compiles = clock.count
    for _ in range(args.warmup):  # measured on CPU: the 2nd request compiled the prefill step again
        time_request(engine, prompt, args.new_tokens)
    start["xla_compiles_first_request"], start["xla_compiles_warmup_requests"] = compiles, clock.count - compiles
    traces, compiles, runs = engine.runner.num_compilations, clock.count, []
    for _ in range(args.repeats):
        runs.append(time_request(engine, prompt, args.new_tokens))
    calls = [ms for r in runs for ms in r["call_step_ms"]]
    decode_s, steps = sum(r["decode_s"] for r in runs), sum(r["decode_steps"] for r in runs)
    out.update({"step_ms": 1e3 * decode_s / steps, "step_ms_pct": percentiles(calls),
                "tok_ms": statistics.mean(r["tok_ms"] for r in runs),
                "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
                "ttft_ms_pct": percentiles([1e3 * r["ttft_s"] for r in runs]),
                "step_traces_in_timed": engine.runner.num_compilations - traces,
                "xla_compiles_in_timed": clock.count - compiles,
                "tokens_same_every_run": all(r["tokens"] == cold["tokens"] for r in runs),
                "tokens_head": cold["tokens"][:16],
                "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]})
    return out


# ------------------------------------------------------------------ transformers (child process)
def hf_mode(model, prompt: list[int], args, static: bool) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_baseline import _hf_batch, hf_compiled, hf_pad_id

    pad, n = hf_pad_id(model), args.new_tokens

    def timed(new: int) -> float:
        t0 = time.perf_counter()
        out, _ = _hf_batch(model, [prompt], new, pad, static=static)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        if len(out[0]) != new:
            raise RuntimeError(f"transformers generated {len(out[0])} tokens, wanted {new}")
        timed.tokens = out[0]
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(args.hf_warmup if static else 1):  # static: compiles, then records the CUDA graphs
        timed(n if static else min(n, 4))  # the static cache's shape is prompt + new: warm up that one
    warm_s = time.perf_counter() - t0
    # All full-length calls first: generate reuses its StaticCache while the shape stays, and a new cache
    # (new addresses) would make the CUDA graphs re-record. max_new_tokens=1 never runs the compiled step.
    full = [timed(n) for _ in range(args.hf_repeats)]
    timed(1)
    ttft = [timed(1) for _ in range(args.hf_repeats)]
    t1 = statistics.median(ttft)
    steps = [1e3 * (f - t1) / max(n - 1, 1) for f in full]
    return {"compiled": hf_compiled(model), "static_cache": static, "warmup_s": warm_s,
            "step_ms": statistics.mean(steps), "step_ms_pct": percentiles(steps),
            "ttft_ms": 1e3 * t1, "ttft_ms_pct": percentiles([1e3 * t for t in ttft]),
            "tokens_head": timed.tokens[:16]}


def hf_child(args) -> None:
    """--side hf: one JSON line per mode appended to --result as soon as it is measured."""
    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_baseline import load_hf

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = load_hf(args.model, args.dtype, device)
    load_s = time.perf_counter() - t0
    prompt = fixed_prompt(args.model, args.prompt_len, args.seed)
    for mode in args.hf_modes:
        record = {"mode": mode, "device": device, "torch": torch.__version__,
                  "transformers": transformers.__version__, "load_s": load_s}
        try:
            record.update(hf_mode(model, prompt, args, static=(mode == "compile")))
        except Exception as e:  # e.g. torch.compile failing on this stack: report it, keep the others
            record["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        with open(args.result, "a") as f:
            f.write(json.dumps(record) + "\n")


def run_hf(path: str, args, log_dir: str | None) -> list[dict]:
    """The transformers side in a child process (bounded by --hf-timeout); returns the modes it finished."""
    result = tempfile_path("lmjax-latency-hf-", ".jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "hf", "--model", path, "--result", result,
           "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--hf-repeats", str(args.hf_repeats), "--hf-warmup", str(args.hf_warmup), "--seed", str(args.seed),
           "--hf-modes", *args.hf_modes] + (["--hf-device", args.hf_device] if args.hf_device else [])
    log = open(os.path.join(log_dir, f"latency-{args.name}-hf.log"), "w") if log_dir else subprocess.DEVNULL
    try:
        code, _ = run_bounded(cmd, args.hf_timeout, stdout=log, stderr=subprocess.STDOUT)
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
    status = f"timed out after {args.hf_timeout} s" if code is None else "ok" if code == 0 else f"exit code {code}"
    with open(result) as f:
        records = [json.loads(line) for line in f if line.strip()]
    os.unlink(result)
    finished = {r["mode"] for r in records}
    records += [{"mode": m, "error": f"not measured: child {status}"} for m in args.hf_modes if m not in finished]
    return records


def tempfile_path(prefix: str, suffix: str) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path


# ------------------------------------------------------------------ report
def rows(result: dict) -> list[tuple]:
    """(engine, step ms, p10, p90, TTFT ms, note) per engine measured."""
    out = []
    lm = result.get("lmjax")
    if lm and "step_ms" in lm:
        p = lm["step_ms_pct"]
        out.append((f"lmjax (K={lm['num_scheduler_steps']})", lm["step_ms"], p.get("p10"), p.get("p90"),
                    lm["ttft_ms"], f"{lm['xla_compiles_in_timed']} XLA compiles in timed runs"))
    for r in result.get("transformers", []):
        name = "transformers " + ("static+compile" if r["mode"] == "compile" else "eager")
        if "error" in r:
            out.append((name, None, None, None, None, r["error"][:120]))
            continue
        p = r["step_ms_pct"]
        note = ""
        if r["mode"] == "compile":
            note = "torch.compile on" if r["compiled"] else "not compiled (static cache only)"
        out.append((name, r["step_ms"], p.get("p10"), p.get("p90"), r["ttft_ms"], note))
    return out


def print_report(result: dict) -> None:
    rf = result["roofline"]
    fmt = lambda v, w, d=3: f"{v:>{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    print(f"latency {result['name']}: {result['dtype']}, prompt {result['prompt_len']}, new {result['new_tokens']}, "
          f"batch 1, device {result.get('lmjax', {}).get('device', '?')}")
    print(f"roofline: {rf['param_bytes'] / 1e9:.3f} GB / {rf['bandwidth']:.3g} B/s = {rf['step_ms']:.3f} ms/step "
          f"({rf['tokens_per_s']:.0f} tok/s)")
    if rf.get("read_bytes", rf["param_bytes"]) != rf["param_bytes"]:
        lm_step = result.get("lmjax", {}).get("step_ms")
        print(f"  bytes a step reads (the untied input embedding apart): {rf['read_bytes'] / 1e9:.3f} GB = "
              f"{rf['read_step_ms']:.3f} ms/step" + (f"; lmjax {lm_step / rf['read_step_ms']:.2f}x of it" if lm_step
                                                      else ""))
    lm = result.get("lmjax", {})
    if "tok_ms" in lm:  # (step ms is per device step: a K-step call's tail past max_tokens counts)
        print(f"  lmjax per token (decode time / (new tokens - 1), as transformers' step ms): {lm['tok_ms']:.3f} ms")
    print(f"{'engine':<28}{'step ms':>9}{'p10':>9}{'p90':>9}{'x roof':>9}{'tok/s':>9}{'TTFT ms':>10}  note")
    for name, step, p10, p90, ttft, note in rows(result):
        ratio = step / rf["step_ms"] if step else None
        tps = 1e3 / step if step else None
        print(f"{name:<28}{fmt(step, 9)}{fmt(p10, 9)}{fmt(p90, 9)}{fmt(ratio, 9, 2)}{fmt(tps, 9, 0)}"
              f"{fmt(ttft, 10, 1)}  {note}")
    s = result.get("lmjax", {}).get("start")
    if s:
        since = f" ({s['script_start_to_first_token_s']:.1f} s after the script started)"
        since = since if result["start_only"] else ""
        print(f"lmjax start: load {s['load_s']:.1f} s, first request {s['first_request_s']:.1f} s "
              f"(TTFT {s['first_ttft_s']:.2f} s), first token {s['start_to_first_token_s']:.1f} s after LLM(){since}; "
              f"{s['step_traces']} step traces, XLA cache hits {s['cache_hits']} / misses (compiled) "
              f"{s['cache_misses']}, compile+load {s['compile_s']:.1f} s, cache {s['cache_dir']}")
        if s.get("load_phases_s"):
            print("lmjax load phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in s["load_phases_s"].items()))
        if "xla_compiles_warmup_requests" in s:
            print(f"lmjax XLA compiles: {s['xla_compiles_first_request']} up to the end of the first request, "
                  f"{s['xla_compiles_warmup_requests']} more in the next (warm-up) request")


# ------------------------------------------------------------------ main
def _bandwidth(value: str):
    if value == "measure":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bandwidth must be B/s or 'measure', got {value!r}") from None


def measured_bandwidth() -> dict:
    """This device's copy rate, measured in this process before the engine starts (kernels_common's
    copies; their 3 GiB of arrays are freed on return, before the engine sizes its KV cache)."""
    from kernels_common import measure_copy_bandwidth

    copy_bw, copies = measure_copy_bandwidth()
    print("copy bandwidth (read+write):", {k: f"{v / 1e12:.3f} TB/s" for k, v in copies.items()})
    return {"bandwidth": copy_bw, "copies": copies}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=sorted(SHAPES), help="random-weight Llama of this shape (written once "
                     "under --checkpoint-root, then reused)")
    src.add_argument("--model", help="HF checkpoint directory (safetensors)")
    p.add_argument("--checkpoint-root", default=None, help="where --shape checkpoints live (default: temp dir)")
    p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed lmjax requests after the first (cold) one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", type=_bandwidth, default=H200_COPY_BANDWIDTH,
                   help="copy bandwidth in B/s, or 'measure' (this device's, in the same run)")
    p.add_argument("--hf-modes", nargs="*", choices=("eager", "compile"), default=["eager", "compile"],
                   help="transformers baselines to run (none: skip transformers)")
    p.add_argument("--hf-repeats", type=int, default=3, help="timed generate calls of each length per mode")
    p.add_argument("--hf-warmup", type=int, default=2, help="full-length warm-up calls in compile mode")
    p.add_argument("--hf-timeout", type=float, default=300, help="seconds for the whole transformers side")
    p.add_argument("--hf-device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--skip-lmjax", action="store_true")
    p.add_argument("--start-only", action="store_true",
                   help="only start the engine and run the first request: load, compile (or cache) figures")
    p.add_argument("--out", default=None, help="directory for the JSON record (and the transformers log)")
    p.add_argument("--side", choices=("hf",), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.side == "hf":
        return hf_child(args)
    write_s = 0.0
    if args.shape:
        path, write_s = ensure_checkpoint(args.shape, args.dtype, args.checkpoint_root, args.seed)
    else:
        path = args.model
    args.name = args.shape or os.path.basename(os.path.normpath(path))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    result = {"name": args.name, "model": path, "checkpoint_write_s": write_s, "dtype": args.dtype,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "start_only": args.start_only}
    if args.hf_modes and not args.start_only:  # first: the child frees the GPU before JAX takes it
        result["transformers"] = run_hf(path, args, args.out)
    measured = measured_bandwidth() if args.bandwidth == "measure" else {}
    result["roofline"] = roofline(path, args.dtype, measured.get("bandwidth", args.bandwidth))
    result["roofline"]["measured_copies"] = measured.get("copies")
    if not args.skip_lmjax:
        result["lmjax"] = run_lmjax(path, fixed_prompt(path, args.prompt_len, args.seed), args)
    print_report(result)
    if args.out:
        suffix = "-start" if args.start_only else ""
        with open(os.path.join(args.out, f"latency-{args.name}{suffix}.json"), "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
