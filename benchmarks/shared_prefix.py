"""Prefix caching within a step: n > 1 samples of each prompt (GRPO / pass@k) and prompts sharing a long
few-shot prefix, with `LLM(enable_prefix_caching=...)` on and off, same prompts, same run:

    python benchmarks/shared_prefix.py --shape llama-3.2-1b          # GPU: random bf16 weights of the shape
    python benchmarks/shared_prefix.py --shape tiny --prompts 4      # CPU smoke run

Workloads (greedy where n = 1, seeded sampling where n > 1; ignore_eos, `--new-tokens` each):
"n": `--prompts` random prompts of `--prompt-len` tokens, each with SamplingParams(n=`--n`) in one generate call;
"few-shot": `--prompts` x `--n` prompts that share their first `--prompt-len` tokens and end in 16 of their own.
Each engine is fresh (its cache empty) and runs the workload once to compile, then `--repeats` timed runs with
the prefix cache reset before each: a hit is always one a run's own sequences made, in its own steps.
Reported: seconds per run, prompt tokens prefilled (the engine's counter), prefix-cache hits, and how far the
outputs with and without caching agree, beside a control: the uncached engine on the same prompts in reverse
batch order (float32: all identical; bf16: both differ alike, near-tied logits flipping under other rounding).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, ensure_checkpoint  # noqa: E402


def workloads(vocab: int, args) -> dict:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    shared = ids(args.prompt_len)
    return {"n": ([ids(args.prompt_len) for _ in range(args.prompts)], args.n),
            "few-shot": ([shared + ids(16) for _ in range(args.prompts * args.n)], 1)}


def run(llm, prompts: list[list[int]], n: int, new_tokens: int):
    from lmjax import SamplingParams

    params = SamplingParams(n=n, temperature=0 if n == 1 else 1.0, seed=0, max_tokens=new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    before = llm.llm_engine.stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.llm_engine.stats()
    return elapsed, after["num_prefill_tokens"] - before["num_prefill_tokens"], \
        after["prefix_cache_hits"] - before["prefix_cache_hits"], [[c.token_ids for c in o.outputs] for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from lmjax import LLM

    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    path = ensure_checkpoint(args.shape, dtype)[0]
    rows, tokens, controls = [], {}, {}
    for caching in (False, True):
        llm = LLM(path, dtype=dtype, max_model_len=args.prompt_len + 16 + args.new_tokens + 64,
                  enable_prefix_caching=caching)
        for name, (prompts, n) in workloads(SHAPES[args.shape]["vocab_size"], args).items():
            run(llm, prompts, n, args.new_tokens)  # compiles
            timed = [run(llm, prompts, n, args.new_tokens) for _ in range(args.repeats)]
            tokens.setdefault(name, []).append(timed[-1][3])
            if not caching:  # the control: the same work in another batch order (other GEMM shapes, same math)
                controls[name] = run(llm, prompts[::-1], n, args.new_tokens)[3][::-1]
            rows.append({"workload": name, "prefix_caching": caching, "s_per_run": statistics.median(t[0] for t in timed),
                         "prefilled_tokens": timed[-1][1], "prefix_cache_hits": timed[-1][2]})
        del llm
    for row in rows:
        print(json.dumps(row))
    for name, (off, on) in tokens.items():
        print(f"{name}: cached vs uncached: {agreement(off, on)} | control, uncached in reverse batch order vs "
              f"uncached: {agreement(off, controls[name])}")
    return 0


def agreement(off: list[list[list[int]]], on: list[list[list[int]]]) -> str:
    """How far the completions with and without caching agree: identical ones, and where the others first
    differ (a cached prefix is the same math in another order: in bf16, near-tied logits of random weights may
    flip later; a wrong KV read would differ from the first token on)."""
    pairs = [(a, b) for o, p in zip(off, on) for a, b in zip(o, p)]
    firsts = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in pairs if a != b]
    same = len(pairs) - len(firsts)
    where = f"; the others first differ at token {min(firsts)} at the earliest, median {statistics.median(firsts)}" \
        if firsts else ""
    return f"{same} of {len(pairs)} completions identical{where}"


if __name__ == "__main__":
    sys.exit(main())
