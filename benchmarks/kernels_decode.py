"""kernels.py's decode section: batch {1, 32, 128} x context {512, 2048, 8192}, Llama-3-8B and
Llama-3.2-1B heads, bf16, block size 16: our kernel vs jax.experimental.pallas.ops.gpu.paged_attention vs
XLA gather + einsum, as a percent of the copy bandwidth. Bytes = K and V of every context token + q + out."""
from __future__ import annotations

import functools
import itertools
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_common import BLOCK_SIZE, BREAKDOWNS, HEADS, add_percents, bench, column, ours  # noqa: E402
from kernels_common import paged_inputs, rel_err, run_rows  # noqa: E402

# The markdown table of the decode rows (kernels.py prints it after every section has run).
TABLE = [column("model", "model"), column("batch", "batch"), column("context", "context"),
         column("ours us", "ours_s", ".1f", 1e6), column("ours %bw", "ours_pct_bw", ".1f"),
         column("jax pallas us", "jax_s", ".1f", 1e6), column("jax %bw", "jax_pct_bw", ".1f"),
         column("xla us", "xla_s", ".1f", 1e6), column("xla %bw", "xla_pct_bw", ".1f")]


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


# ---------------------------------------------------------------- decode
def bench_decode(copy_bw, batches=(1, 32, 128), contexts=(512, 2048, 8192), models=HEADS):
    return run_rows("decode", itertools.product(models, batches, contexts),
                    functools.partial(_decode_row, copy_bw), _decode_line)


def _decode_row(copy_bw, model, batch, ctx):
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
    add_percents(row, ("ours", "xla", "jax"), "pct_bw", nbytes, copy_bw)
    return row


def _decode_line(r):
    return (f"decode {r['model']:12s} B={r['batch']:4d} ctx={r['context']:5d}: ours {r['ours_s'] * 1e6:8.1f} us "
            f"({r['ours_pct_bw']:5.1f}%)  jax {r['jax_s'] * 1e6:8.1f} us "
            f"({r['jax_pct_bw']:5.1f}%)  xla {r['xla_s'] * 1e6:8.1f} us "
            f"({r['xla_pct_bw']:5.1f}%)  err {r['ours_err_vs_xla']:.1e}")
