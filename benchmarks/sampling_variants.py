"""What new combinations of sampling features cost a running engine: rounds of requests as a server's
clients send them, each round another SamplingParams variant (logprobs, top-k, top-p, penalties, logit bias,
bans), on an engine warmed up for greedy decoding (`LLM(enforce_eager=False)`) with an empty persistent
compilation cache, then the same rounds again:

    python benchmarks/sampling_variants.py --shape llama-3.2-1b     # GPU: random bf16 weights of the shape
    python benchmarks/sampling_variants.py --shape tiny --batch 4    # CPU smoke run

Run it once per tree to compare (PYTHONPATH=<tree>): it prints one JSON line per round (pass, variant,
seconds, compilations during the round) and a summary line. Before background compiling, each variant compiled
the model step at every token / batch bucket it met and its multi-step decode call, all on the engine's
thread; after, its first round steps once per call while the decode variant compiles on a worker thread.
Between the passes the worker's compilations are waited for (when the tree has them), so the second pass
(`--repeats` times, interleaved; each variant's median) is the steady state.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, ensure_checkpoint  # noqa: E402

VARIANTS = {
    "greedy": dict(temperature=0),
    "logprobs=1": dict(temperature=0, logprobs=1),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "top_k=40": dict(temperature=0.8, top_k=40),
    "logprobs=5 top_p": dict(temperature=0.7, top_p=0.95, logprobs=5),
    "presence_penalty": dict(temperature=0.8, presence_penalty=0.5),
    "logit_bias": dict(temperature=0.8, logit_bias={11: -5.0, 12: 2.0}),
    "bad_token_ids": dict(temperature=0, bad_token_ids=[11, 12, 13]),
}


def run_round(llm, prompts, variant: dict, new_tokens: int) -> tuple[float, int]:
    from lmjax import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=0, **variant)
    before = llm.llm_engine.runner.num_compilations
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, llm.llm_engine.runner.num_compilations - before


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="second passes (each variant's median reported)")
    p.add_argument("--label", default="", help="a name for this tree in the output")
    args = p.parse_args(argv)
    # An empty persistent cache: what a first start with these clients costs (set before lmjax imports jax).
    os.environ["LMJAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmjax-variants-cache-")
    from lmjax import LLM

    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    path = ensure_checkpoint(args.shape, dtype)[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPES[args.shape]["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_model_len=args.prompt_len + args.new_tokens + 64, enforce_eager=False,
              enable_prefix_caching=False, max_num_seqs=max(args.batch, 4))
    warmup_s = time.perf_counter() - start
    first = {}
    for name, variant in VARIANTS.items():
        first[name] = run_round(llm, prompts, variant, args.new_tokens)
        print(json.dumps({"tree": args.label, "pass": 1, "variant": name, "s": round(first[name][0], 3),
                          "compilations": first[name][1]}), flush=True)
    if hasattr(llm.llm_engine.runner, "wait_for_compiles"):
        llm.llm_engine.runner.wait_for_compiles()
    again = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits every variant alike
        for name, variant in VARIANTS.items():
            again[name].append(run_round(llm, prompts, variant, args.new_tokens))
    for name, runs in again.items():
        print(json.dumps({"tree": args.label, "pass": 2, "variant": name,
                          "median_s": round(statistics.median(s for s, _ in runs), 4),
                          "compilations": sum(c for _, c in runs)}), flush=True)
    print(json.dumps({"tree": args.label, "shape": args.shape, "batch": args.batch, "load_and_warmup_s": round(warmup_s, 1),
                      "pass1_s": round(sum(s for s, _ in first.values()), 2),
                      "pass2_median_sum_s": round(sum(statistics.median(s for s, _ in r) for r in again.values()), 3),
                      "compilations": llm.llm_engine.runner.num_compilations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
