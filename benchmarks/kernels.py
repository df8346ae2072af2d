"""Kernel benchmarks: ragged paged attention (decode and prefill) against baselines and ceilings.

Run on the GPU machine:  python benchmarks/kernels.py [--sections ...] [--json PATH]

Sections:
  ceilings  device copy bandwidth (x + 1 over 1 GiB, bytes read + written) and
            bf16 matmul rate (8192^3), measured in this run: the denominators.
  decode    batch {1, 32, 128} x context {512, 2048, 8192}, Llama-3-8B heads
            (32 q, 8 kv, d 128) and Llama-3.2-1B heads (32 q, 8 kv, d 64), bf16,
            block size 16: ours vs jax.experimental.pallas.ops.gpu.paged_attention
            vs XLA gather + einsum. Bytes = K and V of every context token + q + out.
  prefill   2048-token chunks (fresh, and on 2048 cached tokens), 8B heads:
            ours vs XLA; also JAX's dense Triton flash attention and its Mosaic GPU
            (Hopper) attention on the same causal problem, as backend yardsticks.
  sweep     tiling sweeps of our kernel at the two target shapes.
  kvwrite   RoPE of q/k + paged K/V cache write: our fused kernel (one launch) vs the XLA
            path (rope fusion + two scatters), 8B and 1B heads, T = 1 and 64, bf16, run
            inside a jitted fori_loop with q and the caches as loop carries (as in the
            multi-step decode loop). Per-op time = difference of two loop lengths, CUPTI
            kernel time and wall clock; also counts cache-shaped copies XLA inserted.
            Off GPU it runs the kernel in interpret mode (a smoke test, not a timing).

Timing: kernel time on the GPU through CUPTI (jax.experimental.mosaic.gpu.profiler),
median over iterations, falling back to wall clock around async dispatches.
Shape letters as in pallas_kernels/ragged_paged_attention.py.
One module a section (kernels_decode.py, kernels_prefill.py, kernels_rope.py, kernels_sweep.py), their
shared timing, inputs and table printer in kernels_common.py; this script runs the sections asked for.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_decode  # noqa: E402
import kernels_prefill  # noqa: E402
from kernels_common import _TIMER, BREAKDOWNS, RESULTS, _time_wall, bench, kernel_breakdown  # noqa: E402
from kernels_common import measure_ceilings, print_table  # noqa: E402
from kernels_decode import bench_decode  # noqa: E402
from kernels_prefill import bench_dense_yardsticks, bench_prefill  # noqa: E402
from kernels_rope import bench_kv_write, bench_rope  # noqa: E402
from kernels_sweep import run_sweeps  # noqa: E402

__all__ = ["main", "print_tables", "bench", "_TIMER", "_time_wall"]  # the timing re-exported for importers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="decode,prefill,rope")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    sections = opts.sections.split(",")
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, "
          f"backend {jax.default_backend()}")
    RESULTS["env"] = dict(jax=jax.__version__, device=jax.devices()[0].device_kind)
    copy_bw = mm_rate = None
    if set(sections) - {"kvwrite"}:  # kvwrite reports times only
        copy_bw, mm_rate = measure_ceilings()
    for section, fn in (("sweep", lambda: run_sweeps(copy_bw, mm_rate)),
                        ("decode", lambda: bench_decode(copy_bw)),
                        ("prefill", lambda: (bench_prefill(mm_rate),
                                             bench_dense_yardsticks(mm_rate))),
                        ("rope", lambda: bench_rope(copy_bw)),
                        ("kvwrite", bench_kv_write)):
        if section in sections:
            try:
                fn()
            except Exception:  # noqa: BLE001 - keep the other sections' numbers
                traceback.print_exc()
    RESULTS["timer"] = dict(_TIMER)
    for name, fn, args in BREAKDOWNS:
        kernel_breakdown(name, fn, args)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print_tables()


def print_tables():
    for name, table in (("decode", kernels_decode.TABLE), ("prefill", kernels_prefill.TABLE)):
        if name in RESULTS:
            print_table(table, RESULTS[name])
    print(f"\ntimed calls: {_TIMER}")


if __name__ == "__main__":
    main()
