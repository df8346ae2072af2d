"""kernels.py's RoPE sections.

rope     RoPE of q and k: our kernel (one launch) vs the jnp reference under XLA, as a percent of the
         copy bandwidth.
kvwrite  RoPE of q/k + paged K/V cache write: our fused kernel (one launch) vs the XLA path (rope fusion
         + two scatters), 8B and 1B heads, T = 1 and 64, bf16, run inside a jitted fori_loop with q and
         the caches as loop carries (as in the multi-step decode loop). Per-op time = difference of two
         loop lengths, CUPTI kernel time and wall clock; also counts cache-shaped copies XLA inserted.
         Off GPU it runs the kernel in interpret mode (a smoke test, not a timing).
"""
from __future__ import annotations

import functools
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import BLOCK_SIZE, HEADS, _time_wall, bench, rel_err, run_rows  # noqa: E402


def bench_rope(copy_bw, num_tokens=(32, 2048, 8192), model="llama3-8b"):
    """RoPE on q and k: our kernel (one launch) vs the jnp reference under XLA."""
    from pallas_kernels import rope, rope_kernel
    n, k, h = HEADS[model]
    spec = rope.RopeSpec(rotary_dim=h, theta=500000.0)

    def measure(t):
        keys = jax.random.split(jax.random.key(t), 2)
        q = jax.random.normal(keys[0], (t, n, h), jnp.bfloat16)
        kk = jax.random.normal(keys[1], (t, k, h), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)
        inv = rope.inv_freq_TF(spec, pos + 1)
        nbytes = 2 * (q.nbytes + kk.nbytes) + inv.nbytes + pos.nbytes
        ours_fn = jax.jit(functools.partial(rope_kernel.apply_rope_qk, impl="kernel"))
        ref_fn = jax.jit(functools.partial(rope_kernel.apply_rope_qk, impl="reference"))
        err = max(rel_err(a, b) for a, b in zip(ours_fn(q, kk, pos, inv), ref_fn(q, kk, pos, inv)))
        return dict(tokens=t, bytes=nbytes, err=err, ours_s=bench(ours_fn, q, kk, pos, inv),
                    xla_s=bench(ref_fn, q, kk, pos, inv))

    run_rows("rope", ((t,) for t in num_tokens), measure, functools.partial(_rope_line, model, copy_bw))


def _rope_line(model, copy_bw, r):
    return (f"rope {model} T={r['tokens']}: ours {r['ours_s'] * 1e6:.1f} us "
            f"({100 * r['bytes'] / r['ours_s'] / copy_bw:.0f}% bw)  xla reference "
            f"{r['xla_s'] * 1e6:.1f} us ({100 * r['bytes'] / r['xla_s'] / copy_bw:.0f}% bw)  "
            f"err {r['err']:.1e}")


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

    def measure(model, t):
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
        return row

    run_rows("kvwrite", itertools.product(models, num_tokens), measure, _kv_write_line)


def _kv_write_line(r):
    return (f"rope+kv write {r['model']} T={r['tokens']}: fused {r['fused_s'] * 1e6:.2f} us "
            f"(wall {r['fused_wall_s'] * 1e6:.2f})  xla {r['xla_s'] * 1e6:.2f} us "
            f"(wall {r['xla_wall_s'] * 1e6:.2f})  cache copies fused/xla "
            f"{r['fused_cache_copies']}/{r['xla_cache_copies']}  err {r['err']:.1e}")
