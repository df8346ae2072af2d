"""N-gram speculative decoding against plain decoding, batch 1, greedy (what speculation serves):

    python benchmarks/speculative.py --shape llama-3.2-1b --out DIR      # GPU: random bf16 weights of the shape
    python benchmarks/speculative.py --model /path/or.gguf --prompt-file FILE
    python benchmarks/speculative.py --shape tiny                        # CPU smoke run

Engines (each `LLM(...)` in this process, one after another): "multistep" (the default engine: 8 decode steps
per host round trip), "single" (num_scheduler_steps=1: one step per round trip, as speculation runs) and
"ngram k=K" for each `--k` (speculative_config={"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": --lookup}). Each runs one warm-up request, then `--repeats` timed requests of
`--new-tokens` tokens (greedy, ignore_eos) on the same prompt: ms per output token (decode: from the first
token to the last), engine steps, drafted / accepted tokens. Every engine's tokens must equal the first's
(speculation is exact): a mismatch is reported.

Prompt: `--prompt-file`'s text, else `--prompt-len` random ids made of one random block repeated (so the
lookup finds matches in the prompt). Random weights say nothing about real acceptance rates (their greedy
outputs fall into loops, which the lookup drafts well); they measure what a step costs with and without a
draft. A real checkpoint and prompt measure both.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, ensure_checkpoint  # noqa: E402


def repeated_prompt(vocab: int, length: int, block: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    unit = [rng.randrange(3, vocab) for _ in range(block)]
    return (unit * (length // block + 1))[:length]


def run_engine(model: str, name: str, engine_kw: dict, prompt, args) -> dict:
    from lmjax import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False,  # (repeats)
              gpu_memory_utilization=args.gpu_memory_utilization, **engine_kw)
    engine = llm.llm_engine
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    runs, tokens = [], None
    for i in range(args.repeats + 1):
        drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
        req = engine.add_request(list(ids), params)
        steps, first = 0, None
        while not req.finished:
            engine.step()
            steps += 1
            if first is None and req.completions[0].token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        tokens = req.completions[0].token_ids
        if i:  # the first request compiles
            runs.append({"decode_ms_per_token": (end - first) * 1e3 / (len(tokens) - 1), "steps": steps,
                         "drafted": engine.num_draft_tokens - drafted, "accepted": engine.num_accepted_tokens - accepted})
    del llm, engine, req
    gc.collect()  # the next engine's KV cache needs this one's memory back
    return {"engine": name, "tokens": tokens, "runs": runs,
            "ms_per_token": statistics.median(r["decode_ms_per_token"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--model", default=None, help="a checkpoint instead of --shape's random one")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=32, help="the repeated block of the random prompt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--lookup", type=int, default=3, help="prompt_lookup_max (min 1)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's share (default 0.3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or ensure_checkpoint(args.shape, "bfloat16" if args.shape != "tiny" else "float32")[0]
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read()
    else:
        with open(os.path.join(model, "config.json")) as f:
            prompt = repeated_prompt(json.load(f)["vocab_size"], args.prompt_len, args.block, seed=0)
    engines = [("multistep", {}), ("single", {"num_scheduler_steps": 1})] + [
        (f"ngram k={k}", {"num_scheduler_steps": 1, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup, "prompt_lookup_min": 1}})
        for k in args.k]
    results = [run_engine(model, name, kw, prompt, args) for name, kw in engines]
    base = results[0]
    print(f"{'engine':<12} {'ms/token':>9} {'vs multistep':>12} {'steps':>6} {'accepted/drafted':>17} same tokens")
    for r in results:
        runs = r["runs"]
        acc = f"{sum(x['accepted'] for x in runs)}/{sum(x['drafted'] for x in runs)}"
        print(f"{r['engine']:<12} {r['ms_per_token']:>9.3f} {base['ms_per_token'] / r['ms_per_token']:>11.2f}x "
              f"{statistics.median(x['steps'] for x in runs):>6} {acc:>17} {r['tokens'] == base['tokens']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = os.path.basename(os.path.normpath(args.model)) if args.model else args.shape
        with open(os.path.join(args.out, f"speculative-{name}.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
