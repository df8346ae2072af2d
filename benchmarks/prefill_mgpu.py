"""Prefill attention on the GPU: the Mosaic GPU paged kernel (pallas_kernels/ragged_paged_prefill_mgpu.py)
against the Triton-backend kernel and the public op, same run, as a percent of the bf16 matmul rate.

  JAX_PLATFORMS=cuda python benchmarks/prefill_mgpu.py [--json PATH] [--quick]

First checks the kernel against the float32 reference on ragged batches (prefill chunks on cached
context, decode rows it must leave alone, GQA 4 and 8, head dims 64 and 128, block sizes 64 and 128),
then times 2048-token chunks (fresh, and on 2048 cached tokens) for Llama-3-8B and Llama-3.2-1B heads
over a tiling sweep. FLOPs count only the causal keys (benchmarks/kernels_prefill.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import HEADS, bench, measure_ceilings, paged_inputs, print_table, rel_err  # noqa: E402
from kernels_prefill import causal_flops  # noqa: E402

from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402
from pallas_kernels import ragged_paged_prefill_mgpu as mg  # noqa: E402

CHECKS = [  # (q_lens, kv_lens, N, K, H, S); token counts are multiples of 8, as the kernel needs
    ([300, 1, 74, 1], [300, 90, 200, 5], 32, 8, 128, 64),
    ([129, 62, 1], [1000, 64, 7], 8, 1, 64, 128),
    ([2048], [2048], 32, 8, 128, 64),
    ([511, 2, 1, 998], [2000, 2, 9, 1000], 16, 4, 128, 128),
]


def check(seed, q_lens, kv_lens, n, k, h, s):
    args = paged_inputs(seed, q_lens, kv_lens, n, k, h, s)
    scale = 1 / math.sqrt(h)
    out = jax.jit(functools.partial(mg.ragged_paged_prefill_mgpu, sm_scale=scale))(*args)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    ref = np.asarray(rpa.ragged_paged_attention_reference(*f32, sm_scale=scale))
    merged = rpa.ragged_paged_attention(*args, sm_scale=scale)
    cu = np.asarray(args[5])
    rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b, q in enumerate(q_lens) if q >= 2])
    out = np.asarray(out.astype(jnp.float32))[rows]
    err, merged_err = rel_err(out, ref[rows]), rel_err(np.asarray(merged.astype(jnp.float32)), ref)
    finite = bool(np.isfinite(out).all())
    ok = finite and err < 1e-2 and merged_err < 1e-2
    print(f"check q={q_lens} kv={kv_lens} N={n} K={k} H={h} S={s}: kernel err {err:.2e}, "
          f"op err {merged_err:.2e}, finite {finite} -> {'ok' if ok else 'FAIL'}", flush=True)
    return dict(q_lens=q_lens, kv_lens=kv_lens, heads=(n, k, h), block_size=s, err=err,
                op_err=merged_err, ok=ok)


def time_row(mm_rate, model, cached, block_size, configs, seq=2048):
    n, k, h = HEADS[model]
    kv = cached + seq
    args = paged_inputs(1, [seq], [kv], n, k, h, block_size)
    scale = 1 / math.sqrt(h)
    flops = causal_flops(seq, kv, n, h)
    row = dict(model=model, q_len=seq, kv_len=kv, block_size=block_size, flops=flops)
    triton = jax.jit(functools.partial(rpa.ragged_paged_attention_kernel, sm_scale=scale))
    row["triton_s"] = bench(triton, *args)
    op = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale))
    row["op_s"] = bench(op, *args)
    best = None
    for cfg in configs:
        smem = 2 * (2 * mg.ROWS_PER_WG + cfg.max_steps * cfg.block_kv) * h * 2  # q, o, K and V rings
        if smem > 220 * 1024:
            continue
        fn = jax.jit(functools.partial(mg.ragged_paged_prefill_mgpu, sm_scale=scale, config=cfg))
        try:
            t = bench(fn, *args)
        except Exception as e:  # noqa: BLE001 - e.g. shared memory over the limit
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        pct = 100 * flops / t / mm_rate
        print(f"  {model} kv={kv} S={block_size} {cfg}: {t * 1e6:.1f} us = {pct:.1f}% mm", flush=True)
        if best is None or t < best[0]:
            best = (t, cfg)
    row["mgpu_s"], row["mgpu_cfg"] = best[0], str(best[1])
    for impl in ("triton", "op", "mgpu"):
        row[f"{impl}_pct_mm"] = 100 * flops / row[f"{impl}_s"] / mm_rate
    return row


def time_batch(mm_rate, model, num_seqs, q_len, pad_seqs, configs):
    """An engine-like prefill step: num_seqs fresh prompts of q_len tokens in a batch padded to
    num_seqs + pad_seqs sequences (the static tile bound then counts padding as possible prompts)."""
    n, k, h = HEADS[model]
    q_lens, kv_lens = [q_len] * num_seqs + [0] * pad_seqs, [q_len] * num_seqs + [0] * pad_seqs
    args = paged_inputs(2, q_lens, [max(kv, 1) for kv in kv_lens], n, k, h, 64)
    args = args[:3] + (jnp.asarray(kv_lens, jnp.int32),) + args[4:]
    scale = 1 / math.sqrt(h)
    flops = num_seqs * causal_flops(q_len, q_len, n, h)
    row = dict(model=model, batch=f"{num_seqs} x {q_len} (B={num_seqs + pad_seqs})", flops=flops)
    for name, prefill_impl in (("op", "auto"), ("triton", "triton")):
        fn = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale, prefill_impl=prefill_impl))
        row[f"{name}_s"] = bench(fn, *args)
    for cfg in configs:
        fn = jax.jit(functools.partial(mg.ragged_paged_prefill_mgpu, sm_scale=scale, config=cfg, min_q_len=64))
        row[f"mgpu_ctas{cfg.num_ctas}_s"] = bench(fn, *args)
    print(" ".join(f"{key}={v * 1e6:.1f}us" if key.endswith("_s") else f"{key}={v}" for key, v in row.items()
                   if key != "flops"), f"(op {100 * flops / row['op_s'] / mm_rate:.1f}% mm)", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="default tiling only")
    ap.add_argument("--batches-only", action="store_true", help="only the engine-like batches")
    a = ap.parse_args()
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    copy_bw, mm_rate = measure_ceilings()
    batch_cfgs = [mg.PrefillConfig(), mg.PrefillConfig(num_ctas=132)]
    if a.batches_only:  # 16k tokens of fresh prompts of one length, as in the engine's prefill steps
        for q_len in (128, 256, 512, 1024):
            time_batch(mm_rate, "llama3.2-1b", 16384 // q_len, q_len, 0, batch_cfgs)
            time_batch(mm_rate, "llama3-8b", 16384 // q_len, q_len, 0, batch_cfgs)
        return
    checks = [check(i, *c) for i, c in enumerate(CHECKS)]
    if a.quick:
        configs = [None]
    else:
        # One CTA per (tile, head) item (num_ctas None, the default) vs 132 persistent CTAs.
        configs = [mg.PrefillConfig(block_kv=bkv, max_steps=st, schedule_barrier=sb, num_ctas=ctas)
                   for bkv, st, sb, ctas in ((128, 2, True, None), (128, 2, True, 132),
                                             (128, 2, False, None), (256, 2, True, None))]
    rows = []
    for model in ("llama3-8b", "llama3.2-1b"):
        for cached in (0, 2048):
            for s in (64, 128):
                cfgs = [mg.PrefillConfig()] if configs == [None] else configs
                rows.append(time_row(mm_rate, model, cached, s, cfgs))
    cols = [("model", lambda r: r["model"]), ("kv_len", lambda r: str(r["kv_len"])),
            ("S", lambda r: str(r["block_size"])),
            ("mosaic us", lambda r: f"{r['mgpu_s'] * 1e6:.1f}"),
            ("mosaic %mm", lambda r: f"{r['mgpu_pct_mm']:.1f}"),
            ("triton us", lambda r: f"{r['triton_s'] * 1e6:.1f}"),
            ("triton %mm", lambda r: f"{r['triton_pct_mm']:.1f}"),
            ("op (auto) us", lambda r: f"{r['op_s'] * 1e6:.1f}"),
            ("best tiling", lambda r: r["mgpu_cfg"])]
    print(f"\nbf16 matmul {mm_rate / 1e12:.1f} TFLOP/s, copy {copy_bw / 1e12:.3f} TB/s; "
          f"checks {sum(c['ok'] for c in checks)}/{len(checks)} ok")
    print_table(cols, rows)
    batches = [time_batch(mm_rate, "llama3.2-1b", 128, 128, pad, batch_cfgs) for pad in (0, 896)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(mm_rate=mm_rate, copy_bw=copy_bw, checks=checks, rows=rows, batches=batches), f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
