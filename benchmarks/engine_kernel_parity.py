"""The engine on a GPU with the Pallas attention kernel vs the jnp reference: same greedy tokens (within
bf16 tolerance: we report agreement), and the wall time of each run. Random-weight Llama of a named shape.

    python benchmarks/engine_kernel_parity.py --shape llama-3.2-1b --num-prompts 32 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def run_impl(model_dir: str, impl: str, args, vocab: int) -> dict:
    """One engine run in a fresh process (so each impl compiles its own step)."""
    code = f"""
import json, time, numpy as np
from lmjax import LLM, SamplingParams
rng = np.random.default_rng(0)
prompts = [rng.integers(10, {vocab}, int(n)).tolist() for n in rng.integers(16, {args.max_prompt}, {args.num_prompts})]
llm = LLM({model_dir!r}, dtype={args.dtype!r}, max_model_len=2048, max_num_seqs=64)
params = SamplingParams(temperature=0, max_tokens={args.max_tokens}, ignore_eos=True)
t = time.perf_counter(); llm.generate(prompts[:2], params, use_tqdm=False); warm = time.perf_counter() - t
t = time.perf_counter(); outs = llm.generate(prompts, params, use_tqdm=False); run = time.perf_counter() - t
print("RESULT" + json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "warmup_s": warm, "run_s": run,
      "compilations": llm.llm_engine.runner.num_compilations}}))
"""
    # An impl is an LMJAX_ATTENTION_IMPL value, or VAR=VALUE[;VAR=VALUE...] for any environment.
    env = dict(os.environ, **(dict(kv.split("=", 1) for kv in impl.split(";")) if "=" in impl
                              else {"LMJAX_ATTENTION_IMPL": impl}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--impls", default="kernel,reference",
                        help="two attention impls to compare (or two VAR=VALUE environments, e.g. "
                             "LMJAX_PREFILL_IMPL=mosaic,LMJAX_PREFILL_IMPL=triton)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    from random_model import SHAPES, write_random_checkpoint  # noqa: E402

    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(args.shape, tmp, dtype=args.dtype)
        vocab = SHAPES[args.shape]["vocab_size"]
        results = {impl: run_impl(tmp, impl, args, vocab) for impl in args.impls.split(",")}
        k, r = (results[i]["tokens"] for i in args.impls.split(","))
    same_seq = sum(a == b for a, b in zip(k, r))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(k, r)]
    print(json.dumps({"shape": args.shape, "dtype": args.dtype, "identical_sequences": f"{same_seq}/{len(k)}",
                      "mean_tokens_before_divergence": float(np.mean(first_diff)),
                      **{f"{impl}_{key}": v for impl, res in results.items() for key, v in res.items() if key != "tokens"}}))


if __name__ == "__main__":
    main()
