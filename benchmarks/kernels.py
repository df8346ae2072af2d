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
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402

HEADS = {"llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}
BLOCK_SIZE = 16
RESULTS: dict = {}
# Per-kernel CUPTI breakdowns run last: after one, CUPTI timing stops working.
BREAKDOWNS: list = []


# ---------------------------------------------------------------- timing
def _time_cupti(fn, args, iterations):
    from jax.experimental.mosaic.gpu import profiler
    _, times_ms = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times_ms) * 1e-3


def _time_wall(fn, args, iterations):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iterations):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iterations)
    return statistics.median(samples)


_TIMER = {"cupti": 0, "wall": 0}


def bench(fn, *args, iterations=20) -> float:
    """Median seconds per call of a jitted fn (warmed up first).

    CUPTI sums the GPU time of the call's kernels; a call that launches no
    kernel (a plain device memcpy) or a CUPTI failure falls back, for that
    call only, to wall clock around async dispatches (which is dispatch-bound
    below ~50 us on the device machine).
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    try:
        t = _time_cupti(fn, args, iterations)
        _TIMER["cupti"] += 1
        return t
    except Exception as e:  # noqa: BLE001 - CUPTI may be unavailable
        print(f"# CUPTI timing failed ({type(e).__name__}: {str(e)[:80]}); wall clock")
    _TIMER["wall"] += 1
    return _time_wall(fn, args, iterations)


# ---------------------------------------------------------------- ceilings
def measure_ceilings():
    """Copy bandwidth: the best of a few device copies (XLA's bf16 elementwise
    kernel alone reads low); bf16 matmul rate on random data."""
    x = jax.random.bits(jax.random.key(0), (1 << 29,), jnp.uint32)  # 2 GiB
    copies = {
        "u32 x+1, 2 GiB": (jax.jit(lambda a: a + 1), x),
        "bf16 x+1, 1 GiB": (jax.jit(lambda a: a + 1),
                            jax.random.normal(jax.random.key(0), (1 << 29,), jnp.bfloat16)),
    }
    bandwidths = {}
    for name, (fn, arg) in copies.items():
        bandwidths[name] = 2 * arg.nbytes / bench(fn, arg, iterations=10)
    del x, copies
    copy_bw = max(bandwidths.values())
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = bench(mm, a, b, iterations=10)
    mm_rate = 2 * n ** 3 / t
    RESULTS["ceilings"] = dict(copy_bytes_per_s=copy_bw, copies=bandwidths, bf16_matmul_flops=mm_rate)
    print("copies (read+write):", {k: f"{v / 1e12:.3f} TB/s" for k, v in bandwidths.items()})
    print(f"ceilings: copy {copy_bw / 1e12:.3f} TB/s; bf16 matmul {mm_rate / 1e12:.1f} TFLOP/s")
    return copy_bw, mm_rate


def kernel_breakdown(name, fn, args):
    """Per-kernel GPU times of one call (CUPTI), to see the op's small side kernels."""
    try:
        from jax.experimental.mosaic.gpu import profiler
        jax.block_until_ready(fn(*args))
        _, per_iter = profiler.measure(fn, aggregate=False, iterations=3)(*args)
        kernels = per_iter[-1]
        RESULTS[f"breakdown_{name}"] = kernels
        print(f"kernels of {name}: " + "; ".join(f"{k[:48]} {ms * 1e3:.1f} us" for k, ms in kernels))
    except Exception as e:  # noqa: BLE001
        print(f"breakdown {name} failed: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- inputs
def paged_inputs(seed, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                 dtype=jnp.bfloat16):
    """Random ragged batch over a cache with shuffled blocks (block 0 = sink)."""
    rng = np.random.default_rng(seed)
    blocks_B = [-(-kv // block_size) for kv in kv_lens]
    max_blocks = max(blocks_B)
    num_blocks = 1 + sum(blocks_B)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables_BM = np.zeros((len(kv_lens), max_blocks), np.int32)
    used = 0
    for b, n in enumerate(blocks_B):
        tables_BM[b, :n] = ids[used:used + n]
        used += n
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_PSKH = jax.random.normal(keys[0], shape, dtype)
    v_PSKH = jax.random.normal(keys[1], shape, dtype)
    q_TNH = jax.random.normal(keys[2], (sum(q_lens), num_q_heads, head_dim), dtype)
    cu_B1 = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q_TNH, k_PSKH, v_PSKH, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables_BM),
            jnp.asarray(cu_B1))


def ours(sm_scale, config=None):
    return jax.jit(functools.partial(rpa.ragged_paged_attention_kernel, sm_scale=sm_scale,
                                     config=config))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def xla_decode(q_BNH, k_PSKH, v_PSKH, kv_lens_B, tables_BM, *, sm_scale):
    """Plain XLA: gather each sequence's pages to dense K/V, then masked einsum softmax."""
    num_seqs, num_q_heads, head_dim = q_BNH.shape
    num_kv_heads = k_PSKH.shape[2]
    group = num_q_heads // num_kv_heads
    k_BLKH = k_PSKH[tables_BM].reshape(num_seqs, -1, num_kv_heads, head_dim)
    v_BLKH = v_PSKH[tables_BM].reshape(num_seqs, -1, num_kv_heads, head_dim)
    q_BKGH = q_BNH.reshape(num_seqs, num_kv_heads, group, head_dim)
    s_BKGL = jnp.einsum("bkgh,blkh->bkgl", q_BKGH, k_BLKH,
                        preferred_element_type=jnp.float32) * sm_scale
    valid_BL = jnp.arange(k_BLKH.shape[1])[None, :] < kv_lens_B[:, None]
    s_BKGL = jnp.where(valid_BL[:, None, None, :], s_BKGL, -jnp.inf)
    p_BKGL = jax.nn.softmax(s_BKGL, axis=-1)
    out = jnp.einsum("bkgl,blkh->bkgh", p_BKGL.astype(v_BLKH.dtype), v_BLKH,
                     preferred_element_type=jnp.float32)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q_BNH.dtype)


def jax_paged_attention_fn(num_blocks_per_seq, sm_scale):
    """JAX's Triton paged attention (layout [K, P, S, H]); q pre-scaled (it has no sm_scale)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    ppcb = 8
    k_splits = 16
    while k_splits > 1 and (num_blocks_per_seq % k_splits or num_blocks_per_seq // k_splits < 1):
        k_splits //= 2

    @jax.jit
    def fn(q_BNH, k_KPSH, v_KPSH, tables_BM, kv_lens_B):
        return jpa.paged_attention((q_BNH * sm_scale).astype(q_BNH.dtype), k_KPSH, v_KPSH,
                                   tables_BM, kv_lens_B, pages_per_compute_block=ppcb,
                                   k_splits=k_splits)
    return fn


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------- decode
def bench_decode(copy_bw, batches=(1, 32, 128), contexts=(512, 2048, 8192), models=HEADS):
    rows = []
    for model, batch, ctx in itertools.product(models, batches, contexts):
        n, k, h = HEADS[model]
        args = paged_inputs(0, [1] * batch, [ctx] * batch, n, k, h, BLOCK_SIZE)
        q, kc, vc, kv_lens, tables, cu = args
        scale = 1 / math.sqrt(h)
        nbytes = 2 * batch * ctx * k * h * kc.dtype.itemsize + 2 * q.nbytes
        row = dict(model=model, batch=batch, context=ctx, bytes=nbytes)
        fn = ours(scale)
        out = fn(*args)
        row["ours_s"] = bench(fn, *args)
        if batch == 32 and ctx == 2048:
            BREAKDOWNS.append((f"decode_{model}_b32_ctx2048", fn, args))
        ref = xla_decode(q, kc, vc, kv_lens, tables, sm_scale=scale)
        row["ours_err_vs_xla"] = rel_err(out, ref)
        row["xla_s"] = bench(functools.partial(xla_decode, sm_scale=scale), q, kc, vc, kv_lens,
                             tables)
        try:
            k_KPSH, v_KPSH = kc.transpose(2, 0, 1, 3), vc.transpose(2, 0, 1, 3)
            jfn = jax_paged_attention_fn(tables.shape[1], scale)
            jout = jfn(q, k_KPSH, v_KPSH, tables, kv_lens)
            row["jax_err_vs_xla"] = rel_err(jout, ref)
            row["jax_s"] = bench(jfn, q, k_KPSH, v_KPSH, tables, kv_lens)
            del k_KPSH, v_KPSH
        except Exception as e:  # noqa: BLE001
            row["jax_s"] = float("nan")
            row["jax_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for impl in ("ours", "xla", "jax"):
            row[f"{impl}_pct_bw"] = 100 * nbytes / row[f"{impl}_s"] / copy_bw
        rows.append(row)
        print(f"decode {model:12s} B={batch:4d} ctx={ctx:5d}: ours {row['ours_s'] * 1e6:8.1f} us "
              f"({row['ours_pct_bw']:5.1f}%)  jax {row['jax_s'] * 1e6:8.1f} us "
              f"({row['jax_pct_bw']:5.1f}%)  xla {row['xla_s'] * 1e6:8.1f} us "
              f"({row['xla_pct_bw']:5.1f}%)  err {row['ours_err_vs_xla']:.1e}", flush=True)
        del args, q, kc, vc
    RESULTS["decode"] = rows
    return rows


# ---------------------------------------------------------------- prefill
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
    rows = []
    for model, cached in itertools.product(models, (0, 2048)):
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
        for impl in ("ours", "xla"):
            row[f"{impl}_pct_mm"] = 100 * flops / row[f"{impl}_s"] / mm_rate
        rows.append(row)
        print(f"prefill {model:12s} q={seq} kv={kv}: ours {row['ours_s'] * 1e6:8.1f} us "
              f"({flops / row['ours_s'] / 1e12:6.1f} TFLOP/s, {row['ours_pct_mm']:5.1f}%)  "
              f"xla {row['xla_s'] * 1e6:8.1f} us ({row['xla_pct_mm']:5.1f}%)  "
              f"err {row['ours_err_vs_xla']:.1e}", flush=True)
    RESULTS["prefill"] = rows
    return rows


# ---------------------------------------------------------------- rope
def bench_rope(copy_bw, num_tokens=(32, 2048, 8192), model="llama3-8b"):
    """RoPE on q and k: our kernel (one launch) vs the jnp reference under XLA."""
    from pallas_kernels import rope, rope_kernel
    n, k, h = HEADS[model]
    spec = rope.RopeSpec(rotary_dim=h, theta=500000.0)
    rows = []
    for t in num_tokens:
        keys = jax.random.split(jax.random.key(t), 2)
        q = jax.random.normal(keys[0], (t, n, h), jnp.bfloat16)
        kk = jax.random.normal(keys[1], (t, k, h), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)
        inv = rope.inv_freq_TF(spec, pos + 1)
        nbytes = 2 * (q.nbytes + kk.nbytes) + inv.nbytes + pos.nbytes
        ours_fn = jax.jit(functools.partial(rope_kernel.apply_rope_qk, impl="kernel"))
        ref_fn = jax.jit(functools.partial(rope_kernel.apply_rope_qk, impl="reference"))
        err = max(rel_err(a, b) for a, b in zip(ours_fn(q, kk, pos, inv), ref_fn(q, kk, pos, inv)))
        row = dict(tokens=t, bytes=nbytes, err=err, ours_s=bench(ours_fn, q, kk, pos, inv),
                   xla_s=bench(ref_fn, q, kk, pos, inv))
        rows.append(row)
        print(f"rope {model} T={t}: ours {row['ours_s'] * 1e6:.1f} us "
              f"({100 * nbytes / row['ours_s'] / copy_bw:.0f}% bw)  xla reference "
              f"{row['xla_s'] * 1e6:.1f} us ({100 * nbytes / row['xla_s'] / copy_bw:.0f}% bw)  "
              f"err {err:.1e}", flush=True)
    RESULTS["rope"] = rows


# ---------------------------------------------------------------- rope + kv write
def _kv_loop(op, reps):
    """`reps` applications of op in one jitted fori_loop, q and the caches carried (as the decode
    loop carries its caches): a copy of the cache per iteration would show in the per-op time."""
    def run(q, k, v, pos, inv, slots, k_cache, v_cache):
        def body(_, carry):
            return op(carry[0], k, v, pos, inv, 1.0, carry[1], carry[2], slots)
        return jax.lax.fori_loop(0, reps, body, (q, k_cache, v_cache))
    return jax.jit(run)


def _cache_copies(fn, args, cache_shape):
    """Copies of a cache-shaped array (paged or flat) in the optimized HLO. The caches enter the loop
    undonated, so a copy or two at entry is expected; more than the XLA path's means per-step copies."""
    import re
    P, S, K, H = cache_shape
    shapes = {f"[{P},{S},{K},{H}]", f"[{P * S},{K},{H}]"}
    text = fn.lower(*args).compile().as_text()
    found = re.findall(r"= \w+(\[[\d,]+\])\{[^}]*\} copy(?:-start)?\(", text)
    return sum(shape in shapes for shape in found)


def bench_kv_write(num_tokens=(1, 64), models=("llama3-8b", "llama3.2-1b"), num_pages=512):
    """Fused RoPE + KV write vs the XLA path (apply_rope_reference twice + two scatters)."""
    from pallas_kernels import rope, rope_kv_write as rkw
    on_gpu = jax.default_backend() == "gpu"
    fused = functools.partial(rkw.rope_kv_write, impl="kernel", interpret=not on_gpu)
    reps, wall_iters = ((10, 60), 20) if on_gpu else ((1, 2), 1)  # off GPU: a smoke test
    num_pages = num_pages if on_gpu else 8
    rows = []
    for model, t in itertools.product(models, num_tokens):
        n, k, h = HEADS[model]
        spec = rope.RopeSpec(rotary_dim=h, theta=500000.0, rope_type="llama3", factor=8.0,
                             original_max_position_embeddings=8192)
        keys = jax.random.split(jax.random.key(t), 3)
        q, kk, v = (jax.random.normal(key, (t, heads, h), jnp.bfloat16) for key, heads in zip(keys, (n, k, k)))
        pos = jnp.arange(t, dtype=jnp.int32) + 1000
        slots = jnp.asarray(np.random.default_rng(t).permutation(num_pages * BLOCK_SIZE)[:t], jnp.int32)
        cache = jnp.zeros((num_pages, BLOCK_SIZE, k, h), jnp.bfloat16)
        args = (q, kk, v, pos, rope.inv_freq_TF(spec, pos + 1), slots, cache, cache)
        row = dict(model=model, tokens=t, err=max(rel_err(a, b) for a, b in zip(
            _kv_loop(fused, 1)(*args), _kv_loop(rkw.rope_kv_write_reference, 1)(*args))))
        for name, op in (("fused", fused), ("xla", rkw.rope_kv_write_reference)):
            short, long = (_kv_loop(op, r) for r in reps)
            row[f"{name}_s"] = (bench(long, *args) - bench(short, *args)) / (reps[1] - reps[0])
            row[f"{name}_wall_s"] = ((_time_wall(long, args, wall_iters) - _time_wall(short, args, wall_iters))
                                     / (reps[1] - reps[0]))
            row[f"{name}_cache_copies"] = _cache_copies(long, args, cache.shape)
        rows.append(row)
        print(f"rope+kv write {model} T={t}: fused {row['fused_s'] * 1e6:.2f} us "
              f"(wall {row['fused_wall_s'] * 1e6:.2f})  xla {row['xla_s'] * 1e6:.2f} us "
              f"(wall {row['xla_wall_s'] * 1e6:.2f})  cache copies fused/xla "
              f"{row['fused_cache_copies']}/{row['xla_cache_copies']}  err {row['err']:.1e}", flush=True)
    RESULTS["kvwrite"] = rows


# ---------------------------------------------------------------- sweeps
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
    if "decode" in RESULTS:
        print("\n| model | batch | context | ours us | ours %bw | jax pallas us | jax %bw | xla us | xla %bw |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in RESULTS["decode"]:
            print(f"| {r['model']} | {r['batch']} | {r['context']} | {r['ours_s'] * 1e6:.1f} | "
                  f"{r['ours_pct_bw']:.1f} | {r['jax_s'] * 1e6:.1f} | {r['jax_pct_bw']:.1f} | "
                  f"{r['xla_s'] * 1e6:.1f} | {r['xla_pct_bw']:.1f} |")
    if "prefill" in RESULTS:
        print("\n| model | q_len | kv_len | ours us | ours TFLOP/s | ours %mm | xla us | xla %mm |")
        print("|---|---|---|---|---|---|---|---|")
        for r in RESULTS["prefill"]:
            print(f"| {r['model']} | {r['q_len']} | {r['kv_len']} | {r['ours_s'] * 1e6:.1f} | "
                  f"{r['flops'] / r['ours_s'] / 1e12:.1f} | {r['ours_pct_mm']:.1f} | "
                  f"{r['xla_s'] * 1e6:.1f} | {r['xla_pct_mm']:.1f} |")
    print(f"\ntimed calls: {_TIMER}")


if __name__ == "__main__":
    main()
