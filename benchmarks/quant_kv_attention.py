"""Decode attention over a quantized KV cache (quant_policy 8 / 4) on the GPU: the Triton kernel reading
the codes vs the same kernel over a bf16 cache vs the XLA tiled op (the GPU path for quantized caches
before the kernel read them), as time and percent of the copy bandwidth. Bytes = what the cache holds
for the context (codes + float16 scale + uint8 zero point per token and head, or bf16 K/V) + q + out.

Every kernel output is first checked against the jnp reference over the same cache (float32 math):
"err" is that relative error; "quant err" is the int8 / int4 output against the bf16 cache's, the
quantization's own error on random K/V.

  python benchmarks/quant_kv_attention.py [--quick] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import HEADS, bench, measure_ceilings, paged_inputs, rel_err  # noqa: E402

from lmjax.layers.kv_quant import quantize_cache  # noqa: E402
from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402
from pallas_kernels.quant_kv import QuantKV  # noqa: E402
from pallas_kernels.ragged_paged_attention_tiled import ragged_paged_attention_tiled  # noqa: E402

BLOCK_SIZE = 64  # the engine's default block size


quantize_cache = jax.jit(quantize_cache, static_argnames=("bits", "dtype"))


def cache_bytes(batch, ctx, k, h, bits):
    per_head = 2 * h if bits is None else h * bits // 8 + 3
    return 2 * batch * ctx * k * per_head


def row(copy_bw, model, batch, ctx):
    n, k, h = HEADS[model]
    q, kc, vc, kv_lens, tables, cu = paged_inputs(0, [1] * batch, [ctx] * batch, n, k, h, BLOCK_SIZE)
    meta = (kv_lens, tables, cu)
    scale = 1 / math.sqrt(h)
    kernel = jax.jit(functools.partial(rpa.ragged_paged_attention_kernel, sm_scale=scale))
    reference = jax.jit(functools.partial(rpa.ragged_paged_attention_reference, sm_scale=scale))
    tiled = jax.jit(functools.partial(ragged_paged_attention_tiled, sm_scale=scale))
    out = dict(model=model, batch=batch, context=ctx)
    io_bytes = 2 * q.nbytes
    bf16_out = kernel(q, kc, vc, *meta)
    out["bf16_us"] = bench(kernel, q, kc, vc, *meta) * 1e6
    out["bf16_pct_bw"] = 100 * (cache_bytes(batch, ctx, k, h, None) + io_bytes) / copy_bw / out["bf16_us"] * 1e6
    for bits in (8, 4):
        qk, qv = quantize_cache(kc, bits), quantize_cache(vc, bits)
        quant_args = (q, qk, qv, *meta)
        got = kernel(*quant_args)
        if batch <= 32:  # the reference scans every block of every row: slow on the big cases
            out[f"int{bits}_err"] = rel_err(got, reference(q.astype(jnp.float32), *_f32(qk, qv), *meta))
        out[f"int{bits}_quant_err"] = rel_err(got, bf16_out)
        out[f"int{bits}_us"] = bench(kernel, *quant_args) * 1e6
        out[f"int{bits}_pct_bw"] = (100 * (cache_bytes(batch, ctx, k, h, bits) + io_bytes) / copy_bw
                                    / out[f"int{bits}_us"] * 1e6)
        out[f"int{bits}_tiled_us"] = bench(tiled, *quant_args) * 1e6
        del qk, qv
    return out


SWEEP_ROWS = (("llama3-8b", 1, 8192), ("llama3-8b", 32, 8192), ("llama3-8b", 128, 2048),
              ("llama3.2-1b", 128, 2048))
SWEEP = [dict(block_n=n, num_warps=w, num_stages=st) for n in (64, 128, 256) for w in (4, 8) for st in (2, 3)]


def sweep(copy_bw):
    """int8 / int4 kernel times over kv tile lengths and warps (the tiling heuristic is the bf16 cache's)."""
    for model, batch, ctx in SWEEP_ROWS:
        n, k, h = HEADS[model]
        q, kc, vc, *meta = paged_inputs(0, [1] * batch, [ctx] * batch, n, k, h, BLOCK_SIZE)
        for bits in (8, 4):
            qk, qv = quantize_cache(kc, bits), quantize_cache(vc, bits)
            nbytes = cache_bytes(batch, ctx, k, h, bits) + 2 * q.nbytes
            cells = []
            for cfg in SWEEP:
                fn = jax.jit(functools.partial(rpa.ragged_paged_attention_kernel, sm_scale=1 / math.sqrt(h),
                                               config=cfg))
                t = bench(fn, q, qk, qv, *meta)
                cells.append(f"n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']} {t * 1e6:.1f}us {100 * nbytes / copy_bw / t:.0f}%")
            print(f"sweep {model} b{batch} ctx{ctx} int{bits}: " + "; ".join(cells), flush=True)


def _f32(*caches):
    return [QuantKV(c.data_PSKW, c.scale_PSK, c.zero_PSK, c.bits, "float32") for c in caches]


COLUMNS = [("model", "model", "s"), ("batch", "batch", "d"), ("context", "context", "d"),
           ("bf16 us", "bf16_us", ".1f"), ("bf16 %bw", "bf16_pct_bw", ".1f"),
           ("int8 us", "int8_us", ".1f"), ("int8 %bw", "int8_pct_bw", ".1f"),
           ("int8 XLA tiled us", "int8_tiled_us", ".1f"), ("int4 us", "int4_us", ".1f"),
           ("int4 %bw", "int4_pct_bw", ".1f"), ("int4 XLA tiled us", "int4_tiled_us", ".1f"),
           ("int8 err", "int8_err", ".2e"), ("int4 err", "int4_err", ".2e"),
           ("int8 quant err", "int8_quant_err", ".3f"), ("int4 quant err", "int4_quant_err", ".3f")]


def table(rows):
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(key) is None else format(r[key], fmt)
                                       for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 32, context 2048 only")
    p.add_argument("--json-out")
    p.add_argument("--sweep", action="store_true", help="then time kv tile lengths x warps on four rows")
    args = p.parse_args(argv)
    copy_bw, _ = measure_ceilings()
    batches, contexts = ((32,), (2048,)) if args.quick else ((1, 32, 128), (2048, 8192))
    rows = []
    for model, batch, ctx in itertools.product(HEADS, batches, contexts):
        rows.append(row(copy_bw, model, batch, ctx))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {copy_bw / 1e12:.3f} TB/s, "
          f"block size {BLOCK_SIZE}\n")
    print(table(rows))
    if args.sweep:
        sweep(copy_bw)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(dict(copy_bw=copy_bw, rows=rows)) + "\n")


if __name__ == "__main__":
    main()
