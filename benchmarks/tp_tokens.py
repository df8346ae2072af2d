"""Greedy tokens of the whole engine (`LLM(tensor_parallel_size=tp)`) on a random-weight checkpoint, for
comparing tp sizes on GPUs: prompts of 7, 300, 1, 64 and 129 tokens with 128-token steps, so prefill is
chunked and batches mix prefill and decode. Run once per tp and compare the printed token lists:

    JAX_DEFAULT_MATMUL_PRECISION=highest python benchmarks/tp_tokens.py 1 > tp1.json
    JAX_DEFAULT_MATMUL_PRECISION=highest python benchmarks/tp_tokens.py 2 > tp2.json

float32 (the default here) with highest-precision dots: random weights give near-flat logits, and bf16
rounding in a different reduction order flips near-ties (BENCHMARKS.md, tensor parallelism).
Prints one JSON line: tp, the q/k/v merge's per-device blocks (`Attention.qkv_shards`), seconds, tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, ensure_checkpoint  # noqa: E402

PROMPT_LENS = (7, 300, 1, 64, 129)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tp", type=int)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--checkpoint-root", default=None, help="where the random checkpoint is written once")
    args = parser.parse_args()
    from flax import nnx

    from lmjax import LLM, SamplingParams

    path, _ = ensure_checkpoint(args.shape, args.dtype, root=args.checkpoint_root)
    start = time.perf_counter()
    llm = LLM(path, tensor_parallel_size=args.tp, dtype=args.dtype, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=128, gpu_memory_utilization=0.3)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in PROMPT_LENS],
                        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.runner
    layers = nnx.merge(runner.graphdef, runner.state).layers
    shards = sorted({x.self_attn.qkv_shards for x in layers if x.self_attn.qkv_proj is not None})
    print(json.dumps({"tp": args.tp, "qkv_shards": shards, "seconds": round(time.perf_counter() - start, 1),
                      "tokens": [o.outputs[0].token_ids for o in outs]}))


if __name__ == "__main__":
    main()
