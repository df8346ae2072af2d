"""Issue 9's GPU figures in one command, inside a time budget: batch-1 latency, offline throughput and the
second engine start, each against transformers on the same GPU and weights, logs and JSON under OUT.

    python benchmarks/gpu_suite.py OUT                           # both shapes, as much as fits in --budget
    python benchmarks/gpu_suite.py OUT --shapes llama-3.2-1b     # one shape per command: everything fits
    python benchmarks/gpu_suite.py OUT --shapes tiny --budget 300 --smoke   # CPU smoke run of the plumbing

Steps, in priority order (a step starts only if its minimum time is left; each runs in its own process
under a cap, so one slow or hanging step cannot eat the others' time):
  latency-<shape>      benchmarks/latency.py: lmjax batch-1 step time and TTFT, roofline, transformers eager
                       (+ static cache + torch.compile on the 1B shape); the engine's first, cold start with an
                       empty persistent compilation cache (a fresh directory per suite run).
  second-start-<shape> latency.py --start-only in a new process on the same cache: compilations (XLA cache
                       misses) and the time from LLM() to the first token of a second start.
  throughput-<shape>   benchmarks/throughput.py: 1,000 requests of 128 + 128 tokens (both shapes), transformers
                       static batching at batch 64/128/256 (+ compile on the 1B shape),
                       timed on a subset and extrapolated; a traced batch-64 decode window for the device idle time.
                       `--enforce-eager`: no start-up compilation of every (batch, width) decode bucket (28 of them
                       at max_model_len 512: minutes on the GPU machine's slow host); the untimed warm-up pass (the
                       whole workload once, full budgets) compiles the buckets this workload reaches, and any compilation left in
                       the timed pass is counted and reported.
Random bf16 weights: benchmarks/random_model.py's fast writer (torch draws each tensor on the GPU; safetensors
shards written to /tmp once per machine), so the 8B checkpoint costs tens of seconds, not minutes.

Prints each step's compact table as it finishes and a summary at the end; OUT gets <step>.log (all output),
latency-*.json, throughput.jsonl, profile-*/ (traces) and suite.json (every step's status and figures).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from hf_baseline import run_bounded  # noqa: E402 (a step's whole process group is killed at its cap)
SHAPES = ("llama-3.2-1b", "llama-3-8b")


def steps_for(shape: str, out: str, smoke: bool) -> list[dict]:
    """Each step for one shape, in priority order: name, argv, minimum seconds to start it, cap."""
    big = shape == "llama-3-8b"
    script = lambda name: [sys.executable, os.path.join(HERE, name), "--shape", shape]  # noqa: E731
    lat = script("latency.py") + ["--out", out, "--hf-timeout", "150" if big else "200"]
    if big:  # eager only: torch.compile of the 8B shape would not fit the budget (and issue 9 has no figure)
        lat += ["--hf-modes", "eager", "--repeats", "3"]
    start = script("latency.py") + ["--start-only", "--hf-modes", "--out", out]
    thr = script("throughput.py") + [
        "--dtype", "bfloat16", "--num-prompts", "1000", "--input-len", "128", "--output-len", "128",
        "--max-model-len", "512", "--warmup-prompts", "0", "--warmup-tokens", "0", "--enforce-eager",
        "--hf-subprocess", "--hf-max-requests", "128" if big else "256", "--hf-timeout", "120" if big else "150",
        "--profile", os.path.join(out, f"profile-{shape}"), "--json-out", os.path.join(out, "throughput.jsonl"),
        "--hf-batch-size", *(["64", "128"] if big else ["64", "128", "256", "--hf-compile"])]
    if smoke:  # CPU: small workloads, no compile (later flags win)
        lat += ["--hf-modes", "eager", "--prompt-len", "16", "--new-tokens", "32", "--repeats", "2"]
        start += ["--prompt-len", "16", "--new-tokens", "32"]
        thr = [a for a in thr if a != "--hf-compile"] + [
            "--num-prompts", "32", "--input-len", "16", "--output-len", "16", "--warmup-prompts", "16",
            "--profile-batch", "8"]
    return [dict(name=f"latency-{shape}", argv=lat, min_s=150 if big else 90, cap_s=330 if big else 300),
            dict(name=f"second-start-{shape}", argv=start, min_s=60 if big else 30, cap_s=150 if big else 90),
            dict(name=f"throughput-{shape}", argv=thr, min_s=120 if big else 90, cap_s=330 if big else 300)]


def order(shapes: list[str], out: str, smoke: bool) -> list[dict]:
    """1B first (all its steps), then the 8B shape; the 8B second start is the least important."""
    steps = [s for shape in shapes for s in steps_for(shape, out, smoke)]
    last = [s for s in steps if s["name"] == "second-start-llama-3-8b"]
    return [s for s in steps if s not in last] + last


def run_step(step: dict, out: str, env: dict, seconds: float) -> dict:
    """Run one step under `seconds`; its output goes to OUT/<name>.log, its table lines to our stdout."""
    log_path = os.path.join(out, f"{step['name']}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(step["argv"]) + "\n")
        log.flush()
        code, stdout = run_bounded(step["argv"], seconds, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO,
                                   text=True)
        status = (f"killed at its cap of {seconds:.0f} s" if code is None else "ok" if code == 0
                  else f"failed (exit {code}, see {log_path})")
        log.write(stdout or "")
    for line in (stdout or "").splitlines():
        if not line.startswith("{"):  # throughput.py's full JSON line stays in the log and throughput.jsonl
            print(line)
    if status != "ok":
        with open(log_path) as f:
            tail = f.read()[-1500:]
        print(f"[{step['name']}] {status}; last lines of its log:\n{tail}")
    return {"name": step["name"], "status": status, "seconds": round(time.perf_counter() - t0, 1),
            "command": " ".join(step["argv"])}


def figures(out: str) -> dict:
    """The headline numbers from the JSON the steps wrote (whatever exists)."""
    found = {}
    for file in sorted(os.listdir(out)):
        path = os.path.join(out, file)
        if file.startswith("latency-") and file.endswith(".json"):
            with open(path) as f:
                r = [json.loads(line) for line in f if line.strip()][-1]
            lm = r.get("lmjax", {})
            key = f"{'second-start' if r['start_only'] else 'latency'}-{r['name']}"
            roof = r["roofline"]["step_ms"]
            found[key] = {"roofline_ms": round(roof, 3), "lmjax_step_ms": lm.get("step_ms"),
                          "lmjax_x_roofline": lm["step_ms"] / roof if "step_ms" in lm else None,
                          "lmjax_ttft_ms": lm.get("ttft_ms"), "start": lm.get("start"),
                          "transformers": {t["mode"]: t.get("step_ms", t.get("error"))
                                           for t in r.get("transformers", [])}}
        elif file == "throughput.jsonl":
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    lm = r.get("lmjax", {})
                    found[f"throughput-{r['model']}"] = {
                        "num_prompts": r["num_prompts"], "lmjax_out_tps": lm.get("output_tokens_per_s"),
                        "transformers_out_tps": r.get("transformers", {}).get("output_tokens_per_s"),
                        "ratio": r.get("output_tps_ratio"),
                        "idle_fraction": lm.get("device_profile", {}).get("idle_fraction")}
    return found


def environment() -> dict:
    env = {"python": sys.version.split()[0]}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        env["gpu"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole suite")
    parser.add_argument("--cache-dir", default=None, help="compilation cache (default: a fresh one under /tmp)")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads (CPU check of the plumbing)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    cache = args.cache_dir or f"/tmp/lmjax-suite-cache-{int(time.time())}"
    env = {**os.environ, "LMJAX_COMPILATION_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    record = {"environment": environment(), "budget_s": args.budget, "cache_dir": cache, "steps": []}
    print(f"gpu_suite: {record['environment']}, budget {args.budget:.0f} s, compile cache {cache}", flush=True)
    for step in order(args.shapes, args.out, args.smoke):
        left = args.budget - (time.perf_counter() - t0) - 10  # keep 10 s for the summary
        if left < step["min_s"]:
            print(f"[{step['name']}] skipped: {left:.0f} s left, it needs at least {step['min_s']} s", flush=True)
            record["steps"].append({"name": step["name"], "status": f"skipped ({left:.0f} s left)"})
            continue
        print(f"\n=== {step['name']} (cap {min(step['cap_s'], left):.0f} s)", flush=True)
        result = run_step(step, args.out, env, min(step["cap_s"], left))
        print(f"[{step['name']}] {result['status']} in {result['seconds']} s", flush=True)
        record["steps"].append(result)
    record["figures"] = figures(args.out)
    record["total_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n=== summary ({record['total_s']} s)")
    for s in record["steps"]:
        print(f"{s['name']:<28} {s['status']:<40} {s.get('seconds', '')}")
    print(json.dumps(record["figures"], indent=None, default=str)[:4000])


if __name__ == "__main__":
    main()
