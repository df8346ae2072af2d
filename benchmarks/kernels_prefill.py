"""kernels.py's prefill section: 2048-token chunks (fresh, and on 2048 cached tokens), our kernel vs
XLA as a percent of the bf16 matmul rate; also JAX's dense Triton flash attention and its Mosaic GPU
(Hopper) attention on the same causal problem, as backend yardsticks."""
from __future__ import annotations

import functools
import itertools
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import BLOCK_SIZE, BREAKDOWNS, HEADS, RESULTS, add_percents, bench, column  # noqa: E402
from kernels_common import ours, paged_inputs, rel_err, run_rows  # noqa: E402

# The markdown table of the prefill rows (kernels.py prints it after every section has run).
TABLE = [column("model", "model"), column("q_len", "q_len"), column("kv_len", "kv_len"),
         column("ours us", "ours_s", ".1f", 1e6),
         ("ours TFLOP/s", lambda r: f"{r['flops'] / r['ours_s'] / 1e12:.1f}"),
         column("ours %mm", "ours_pct_mm", ".1f"),
         column("xla us", "xla_s", ".1f", 1e6), column("xla %mm", "xla_pct_mm", ".1f")]


def causal_flops(q_len, kv_len, num_q_heads, head_dim):
    """2 matmuls x 2 flops x (keys each query attends) x N x H."""
    first = kv_len - q_len + 1
    keys = q_len * (first + kv_len) // 2
    return 4 * keys * num_q_heads * head_dim


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def xla_prefill(q_TNH, k_PSKH, v_PSKH, kv_len, tables_M, *, sm_scale):
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    num_kv_heads = k_PSKH.shape[2]
    k_LKH = k_PSKH[tables_M].reshape(-1, num_kv_heads, head_dim)
    v_LKH = v_PSKH[tables_M].reshape(-1, num_kv_heads, head_dim)
    q_TKGH = q_TNH.reshape(num_tokens, num_kv_heads, -1, head_dim)
    s = jnp.einsum("tkgh,lkh->tkgl", q_TKGH, k_LKH, preferred_element_type=jnp.float32) * sm_scale
    pos_T = kv_len - num_tokens + jnp.arange(num_tokens)
    mask = jnp.arange(k_LKH.shape[0])[None, :] <= pos_T[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_LKH.dtype)
    out = jnp.einsum("tkgl,lkh->tkgh", p, v_LKH, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q_TNH.dtype)


def bench_dense_yardsticks(mm_rate, seq=2048, model="llama3-8b"):
    """JAX's own dense causal flash attention, Triton vs Mosaic GPU, same problem size."""
    n, k, h = HEADS[model]
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, seq, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (1, seq, k, h), jnp.bfloat16)
    vv = jax.random.normal(keys[2], (1, seq, k, h), jnp.bfloat16)
    flops = causal_flops(seq, seq, n, h)
    out = {}
    try:
        from jax.experimental.pallas.ops.gpu import attention as tri
        rep = n // k  # the Triton mha wants as many kv heads as q heads
        kr, vr = jnp.repeat(kk, rep, axis=2), jnp.repeat(vv, rep, axis=2)
        fn = jax.jit(functools.partial(tri.mha, segment_ids=None, sm_scale=1 / math.sqrt(h),
                                       causal=True))
        out["jax_triton_mha_s"] = bench(fn, q, kr, vr)
    except Exception as e:  # noqa: BLE001
        out["jax_triton_mha_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
        best = None
        for block_kv in (128, 64):
            try:
                cfg = mg.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                      causal=True)
                fn = jax.jit(functools.partial(mg.attention, config=cfg))
                # It rejects bf16 in this jax (a dtype check bug): time it in fp16.
                t = bench(fn, *(a.astype(jnp.float16) for a in (q, kk, vv)))
                best = t if best is None else min(best, t)
            except Exception as e:  # noqa: BLE001
                out[f"jax_mgpu_error_{block_kv}"] = f"{type(e).__name__}: {str(e)[:300]}"
        if best is not None:
            out["jax_mosaic_gpu_attention_s"] = best
    except Exception as e:  # noqa: BLE001
        out["jax_mosaic_gpu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for key in list(out):
        if key.endswith("_s"):
            out[key.replace("_s", "_pct_mm")] = 100 * flops / out[key] / mm_rate
    print("dense causal yardsticks (2048, 8B heads):", {k: v for k, v in out.items()})
    RESULTS["dense_yardsticks"] = out
    return out


def bench_prefill(mm_rate, seq=2048, models=("llama3-8b", "llama3.2-1b")):
    return run_rows("prefill", itertools.product(models, (0, 2048)),
                    functools.partial(_prefill_row, mm_rate, seq), _prefill_line)


def _prefill_row(mm_rate, seq, model, cached):
    n, k, h = HEADS[model]
    kv = cached + seq
    args = paged_inputs(1, [seq], [kv], n, k, h, BLOCK_SIZE)
    q, kc, vc, kv_lens, tables, cu = args
    scale = 1 / math.sqrt(h)
    flops = causal_flops(seq, kv, n, h)
    fn = ours(scale)
    out = fn(*args)
    row = dict(model=model, q_len=seq, kv_len=kv, flops=flops, ours_s=bench(fn, *args))
    if cached == 0:
        BREAKDOWNS.append((f"prefill_{model}_kv{kv}", fn, args))
    xla = functools.partial(xla_prefill, sm_scale=scale)
    ref = xla(q, kc, vc, kv_lens[0], tables[0])
    row["ours_err_vs_xla"] = rel_err(out, ref)
    row["xla_s"] = bench(xla, q, kc, vc, kv_lens[0], tables[0])
    add_percents(row, ("ours", "xla"), "pct_mm", flops, mm_rate)
    return row


def _prefill_line(r):
    return (f"prefill {r['model']:12s} q={r['q_len']} kv={r['kv_len']}: ours {r['ours_s'] * 1e6:8.1f} us "
            f"({r['flops'] / r['ours_s'] / 1e12:6.1f} TFLOP/s, {r['ours_pct_mm']:5.1f}%)  "
            f"xla {r['xla_s'] * 1e6:8.1f} us ({r['xla_pct_mm']:5.1f}%)  "
            f"err {r['ours_err_vs_xla']:.1e}")
