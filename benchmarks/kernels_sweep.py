"""kernels.py's sweep section: tiling sweeps of our kernel at the two target shapes (decode batch 32 x
context 2048, one 2048-token prefill chunk), the best six configs of each as a percent of the ceiling."""
from __future__ import annotations

import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import BLOCK_SIZE, HEADS, RESULTS, bench, ours, paged_inputs  # noqa: E402
from kernels_prefill import causal_flops  # noqa: E402


def sweep(name, args, scale, grid, denom_fn):
    results = []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        try:
            t = bench(ours(scale, cfg), *args)
            results.append((t, cfg))
        except Exception as e:  # noqa: BLE001
            results.append((float("inf"), dict(cfg, error=f"{type(e).__name__}: {str(e)[:120]}")))
    results.sort(key=lambda r: r[0])
    print(f"sweep {name}: best 6")
    for t, cfg in results[:6]:
        print(f"  {t * 1e6:8.1f} us  {denom_fn(t):5.1f}%  {cfg}")
    errors = [c for t, c in results if "error" in c]
    if errors:
        print(f"  {len(errors)} configs failed, e.g. {errors[0]}")
    RESULTS[f"sweep_{name}"] = [dict(cfg, seconds=t) for t, cfg in results]


def run_sweeps(copy_bw, mm_rate):
    for model in ("llama3-8b", "llama3.2-1b"):
        n, k, h = HEADS[model]
        args = paged_inputs(0, [1] * 32, [2048] * 32, n, k, h, BLOCK_SIZE)
        nbytes = 2 * 32 * 2048 * k * h * 2
        sweep(f"decode_b32_ctx2048_{model}", args, 1 / math.sqrt(h),
              dict(block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3), num_splits=(1, 2)),
              lambda t: 100 * nbytes / t / copy_bw)
    for model in ("llama3-8b", "llama3.2-1b"):
        n, k, h = HEADS[model]
        args = paged_inputs(1, [2048], [2048], n, k, h, BLOCK_SIZE)
        flops = causal_flops(2048, 2048, n, h)
        sweep(f"prefill_2048_{model}", args, 1 / math.sqrt(h),
              dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3)),
              lambda t: 100 * flops / t / mm_rate)
