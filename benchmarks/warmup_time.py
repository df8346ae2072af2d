"""Engine start-up with warm-up (`LLM(enforce_eager=False)`): how long the warm-up's compilations take on one
thread and on a pool (LMJAX_COMPILE_THREADS, lmjax/engine/parallel_compile.py), with an empty persistent
compilation cache (first start) and again with the cache it left (second start).

    python benchmarks/warmup_time.py --shape llama-3.2-1b --threads 8 1     # GPU: random bf16 weights
    python benchmarks/warmup_time.py --shape tiny --threads 2 1             # CPU smoke run

Each start is a child process of its own (a fresh JAX); per `--threads` value a fresh cache directory, started
`--starts` times. Reported per start: the load, the warm-up (seconds, compilations = traces, the pool's
lowering seconds and its wait for the last compilations), JAX's XLA compilations or cache loads (CompileClock),
and the first token of one request after LLM() returned. Same engine settings as compile_stalls.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_clock import CompileClock  # noqa: E402
from random_model import ensure_checkpoint  # noqa: E402


def child(args) -> None:
    clock = CompileClock()
    from lmjax import LLM, SamplingParams

    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    path = ensure_checkpoint(args.shape, dtype)[0]
    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_model_len=args.max_model_len, enforce_eager=False, enable_prefix_caching=False)
    ready = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(5, 37))}], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.perf_counter()
    stats = llm.llm_engine.warmup_stats
    print(json.dumps({"threads": args.threads[0], "start": args.start, "llm_s": round(ready - start, 1),
                      "load_s": round(ready - start - stats["seconds"], 1), "warmup": stats,
                      "xla_compiles_or_loads": clock.snapshot()[1],
                      "first_token_after_llm_s": round(first - ready, 2)}),
          flush=True)


def parent(args) -> int:
    rows = []
    for threads in args.threads:
        env = {**os.environ, "LMJAX_COMPILE_THREADS": str(threads),
               "LMJAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="lmjax-warmup-cache-")}
        for start in range(1, args.starts + 1):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape, "--threads",
                   str(threads), "--start", str(start), "--max-model-len", str(args.max_model_len)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if args.log_dir:
                with open(os.path.join(args.log_dir, f"warmup_t{threads}_s{start}.log"), "w") as f:
                    f.write(proc.stderr)
            if proc.returncode:
                print(proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| threads | start | LLM() s | load s | warm-up s | compilations | lowering s | wait after lowering s "
          "| XLA compiles / cache loads | first token after LLM() s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["warmup"]
        print(f"| {r['threads']} | {r['start']} | {r['llm_s']} | {r['load_s']} | {w['seconds']:.1f} "
              f"| {w['compilations']} | {w['lower_seconds']} | {w['compile_wait_seconds']} "
              f"| {r['xla_compiles_or_loads']} | {r['first_token_after_llm_s']} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--threads", type=int, nargs="+", default=[8, 1])
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048 + 32 + 64)
    p.add_argument("--log-dir", help="write each start's engine log (stderr) there")
    p.add_argument("--child", action="store_true")
    p.add_argument("--start", type=int, default=1)
    args = p.parse_args()
    if args.child:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
