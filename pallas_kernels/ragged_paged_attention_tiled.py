"""Ragged paged attention in plain XLA for machines without the Pallas kernel (CPU): same contract as
`ragged_paged_attention_reference`, but it only visits the cache blocks a query can see.

The reference scans every block of the padded block table for every query row. Here query rows go in
tiles of R; each tile loops (a dynamic trip count) over the blocks from the first its window can see
to the last its furthest position reaches, so a prefill chunk costs the causal triangle instead of the
square, and decode rows cost their own context rather than the table's bucket. A tile whose rows all
belong to one sequence (the common case inside a prefill chunk) reads each block once for the tile
instead of once per row.

Shape letters as in ragged_paged_attention.py: T tokens, N q heads, K kv heads, G = N / K, H head dim,
P blocks, S block size, B sequences, M blocks per sequence; R rows per tile, X tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention_reference import _M_INIT, _token_metadata, validate_ragged_paged_attention

_HIGHEST = jax.lax.Precision.HIGHEST


def _block_scores(q_RKGH, k_RSKH, v_RSKH, mask_RS, sm_scale, carry):
    """One online-softmax update of a tile with one block of keys (per-row K/V)."""
    max_RKG, denom_RKG, acc_RKGH = carry
    # Unseen slots may hold anything, NaN included: masked scores become -inf whatever K held, but
    # 0 * NaN is NaN, so V must be zeroed.
    v_RSKH = jnp.where(mask_RS[:, :, None, None], v_RSKH, 0.0)
    s_RKGS = jnp.einsum("rkgh,rskh->rkgs", q_RKGH, k_RSKH, precision=_HIGHEST) * sm_scale
    s_RKGS = jnp.where(mask_RS[:, None, None, :], s_RKGS, -jnp.inf)
    new_max_RKG = jnp.maximum(max_RKG, s_RKGS.max(axis=-1))
    p_RKGS = jnp.exp(s_RKGS - new_max_RKG[..., None])
    alpha_RKG = jnp.exp(max_RKG - new_max_RKG)
    denom_RKG = denom_RKG * alpha_RKG + p_RKGS.sum(axis=-1)
    acc_RKGH = acc_RKGH * alpha_RKG[..., None] + jnp.einsum("rkgs,rskh->rkgh", p_RKGS, v_RSKH, precision=_HIGHEST)
    return new_max_RKG, denom_RKG, acc_RKGH


def _tile(q_RKGH, seq_R, pos_R, valid_R, k_cache, v_cache, block_tables_BM, *, sm_scale, sliding_window):
    R, K, G, H = q_RKGH.shape
    S = k_cache.shape[1]
    blocks_RM = block_tables_BM[seq_R]
    last_pos = jnp.max(jnp.where(valid_R, pos_R, -1))
    hi = (last_pos + S) // S  # blocks [0, hi) hold every key this tile can see
    lo = 0
    if sliding_window is not None:
        first_pos = jnp.min(jnp.where(valid_R, pos_R, jnp.iinfo(jnp.int32).max))
        lo = jnp.maximum(first_pos - sliding_window + 1, 0) // S
    one_seq = jnp.all(jnp.where(valid_R, seq_R == seq_R[0], True))
    offsets_S = jnp.arange(S, dtype=jnp.int32)

    def body(m, carry):
        key_pos_S = m * S + offsets_S
        mask_RS = (key_pos_S[None, :] <= pos_R[:, None]) & valid_R[:, None]
        if sliding_window is not None:
            mask_RS &= key_pos_S[None, :] > pos_R[:, None] - sliding_window

        def shared(_):  # one gather for the whole tile, broadcast to its rows
            k = jnp.broadcast_to(k_cache[blocks_RM[0, m]].astype(jnp.float32)[None], (R, S, K, H))
            v = jnp.broadcast_to(v_cache[blocks_RM[0, m]].astype(jnp.float32)[None], (R, S, K, H))
            return k, v

        def per_row(_):
            return k_cache[blocks_RM[:, m]].astype(jnp.float32), v_cache[blocks_RM[:, m]].astype(jnp.float32)

        k_RSKH, v_RSKH = jax.lax.cond(one_seq, shared, per_row, None)
        return _block_scores(q_RKGH, k_RSKH, v_RSKH, mask_RS, sm_scale, carry)

    init = (jnp.full((R, K, G), _M_INIT, jnp.float32), jnp.zeros((R, K, G), jnp.float32),
            jnp.zeros((R, K, G, H), jnp.float32))
    _, denom_RKG, acc_RKGH = jax.lax.fori_loop(lo, hi, body, init)
    return acc_RKGH / jnp.where(denom_RKG > 0, denom_RKG, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "rows_per_tile"))
def ragged_paged_attention_tiled(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                                 *, sm_scale: float, sliding_window: int | None = None, rows_per_tile: int = 64):
    """XLA implementation for CPUs: float32 softmax, output in q's dtype, padding rows zero."""
    validate_ragged_paged_attention(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                                    cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window)
    T, N, H = q_TNH.shape
    K, B = k_cache_PSKH.shape[2], kv_lens_B.shape[0]
    # Decode-like steps (a few rows per sequence) get short tiles: a tile loops up to its longest
    # row's context, so tiles of rows with similar contexts waste the least.
    R = min(rows_per_tile if T > 4 * B else min(rows_per_tile, 16), T)
    X = -(-T // R)
    seq_T, pos_T, valid_T = _token_metadata(kv_lens_B, cu_q_lens_B1, X * R)
    # Rows ordered by their sequence's context length (stable: each sequence's rows stay together and
    # in order, so prefill tiles still share one gather per block); padding rows last.
    order_T = jnp.argsort(jnp.where(valid_T, kv_lens_B[seq_T], jnp.iinfo(jnp.int32).max),
                          stable=True)
    q_TKGH = jnp.pad(q_TNH.astype(jnp.float32), ((0, X * R - T), (0, 0), (0, 0))).reshape(X * R, K, N // K, H)
    tile = functools.partial(_tile, k_cache=k_cache_PSKH, v_cache=v_cache_PSKH, block_tables_BM=block_tables_BM,
                             sm_scale=sm_scale, sliding_window=sliding_window)
    xs = (q_TKGH[order_T].reshape(X, R, K, N // K, H), seq_T[order_T].reshape(X, R), pos_T[order_T].reshape(X, R),
          valid_T[order_T].reshape(X, R))
    out_sorted_TNH = jax.lax.map(lambda x: tile(*x), xs).reshape(X * R, N, H)
    out_TNH = jnp.zeros_like(out_sorted_TNH).at[order_T].set(out_sorted_TNH)[:T]
    return jnp.where(valid_T[:T, None, None], out_TNH, 0.0).astype(q_TNH.dtype)
