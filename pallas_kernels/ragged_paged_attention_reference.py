"""Ragged paged attention's contract and its jnp reference (the CPU production path is the tiled XLA
version, ragged_paged_attention_tiled.py, built on the same row metadata).

`validate_ragged_paged_attention` checks static shapes, dtypes and scalars for every implementation.
`ragged_paged_attention_dense_reference` gives the same values from dense masked scores: the derivative
path (its jvp / grad memory is dense attention's; the scan's is that times the head dim).
Shape letters and semantics: pallas_kernels/ragged_paged_attention.py.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._pallas_util import FLOAT_DTYPES
from pallas_kernels.kv_tiles import kernel_reads
from pallas_kernels._validate import IMPLS as KERNEL_IMPLS
from pallas_kernels._validate import (
    is_power_of_two,
    require,
    require_dim,
    require_dtype,
    require_impl,
    require_rank,
)

IMPLS = (*KERNEL_IMPLS, "tiled")
# Finite stand-in for -inf in the running max: exp2(-inf - (-inf)) would be NaN
# for rows that have seen no key yet, exp2(-inf - _M_INIT) is 0.
_M_INIT = -1e30


# --------------------------------------------------------------------------
# Validation (shared by kernel and reference)
# --------------------------------------------------------------------------
def validate_ragged_paged_attention(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale, sliding_window, impl="auto", for_kernel=False,
) -> None:
    """Check static shapes, dtypes and scalars; raise ValueError naming the bad value."""
    require_rank("q_TNH", q_TNH, 3, "T, N, H")
    require_rank("k_cache_PSKH", k_cache_PSKH, 4, "P, S, K, H")
    require_rank("kv_lens_B", kv_lens_B, 1, "B")
    require_rank("block_tables_BM", block_tables_BM, 2, "B, M")
    require_rank("cu_q_lens_B1", cu_q_lens_B1, 1, "B+1")
    require(
        tuple(v_cache_PSKH.shape) == tuple(k_cache_PSKH.shape),
        f"v_cache_PSKH.shape={tuple(v_cache_PSKH.shape)} must equal "
        f"k_cache_PSKH.shape={tuple(k_cache_PSKH.shape)}",
    )
    for name, x in (("q_TNH", q_TNH), ("k_cache_PSKH", k_cache_PSKH), ("v_cache_PSKH", v_cache_PSKH)):
        require_dtype(name, x, FLOAT_DTYPES)
    require(
        q_TNH.dtype == k_cache_PSKH.dtype == v_cache_PSKH.dtype,
        f"dtypes must match: q_TNH.dtype={q_TNH.dtype}, k_cache_PSKH.dtype="
        f"{k_cache_PSKH.dtype}, v_cache_PSKH.dtype={v_cache_PSKH.dtype}",
    )
    for name, x in (("kv_lens_B", kv_lens_B), ("block_tables_BM", block_tables_BM),
                    ("cu_q_lens_B1", cu_q_lens_B1)):
        require_dtype(name, x, ("int32",))
    _, num_q_heads, head_dim = q_TNH.shape
    _, block_size, num_kv_heads, _ = k_cache_PSKH.shape
    num_seqs = kv_lens_B.shape[0]
    require(block_size >= 1, f"block_size={block_size} must be >= 1")
    require(num_kv_heads >= 1, f"num_kv_heads={num_kv_heads} must be >= 1")
    require(
        num_q_heads % num_kv_heads == 0,
        f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}",
    )
    require_dim("k_cache_PSKH", k_cache_PSKH, 3, head_dim, "head_dim of q_TNH")
    require_dim("block_tables_BM", block_tables_BM, 0, num_seqs, "len(kv_lens_B)")
    require_dim("cu_q_lens_B1", cu_q_lens_B1, 0, num_seqs + 1, "len(kv_lens_B) + 1")
    require(
        isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0,
        f"sm_scale={sm_scale!r} must be a positive finite Python float",
    )
    require(
        sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
        f"sliding_window={sliding_window!r} must be None or an int >= 1",
    )
    require_impl(impl, IMPLS)
    if for_kernel:
        # Triton tiles need power-of-two extents ("auto" takes the tiled version for other head sizes).
        require(
            is_power_of_two(head_dim) and 16 <= head_dim <= 256,
            f"head_dim={head_dim} must be a power of two in [16, 256] for the kernel",
        )
        # An int4 cache's dots run on half heads (even / odd channels), and a Triton dot needs 16.
        require(kernel_reads(k_cache_PSKH, head_dim),
                f"head_dim={head_dim} must be >= 32 for the kernel over an int4 (quant_policy 4) cache")


# --------------------------------------------------------------------------
# Reference (jnp): scan over cache blocks with an online softmax
# --------------------------------------------------------------------------
def _token_metadata(kv_lens_B, cu_q_lens_B1, num_tokens: int):
    """Per query row: its sequence, absolute position, and whether it is a real row."""
    t_T = jnp.arange(num_tokens, dtype=jnp.int32)
    # Row t belongs to the last sequence b with cu_q_lens[b] <= t.
    seq_T = jnp.searchsorted(cu_q_lens_B1, t_T, side="right", method="compare_all") - 1
    seq_T = seq_T.astype(jnp.int32)
    num_seqs = kv_lens_B.shape[0]
    seq_T = jnp.clip(seq_T, 0, num_seqs - 1)
    valid_T = t_T < cu_q_lens_B1[-1]
    q_len_T = cu_q_lens_B1[seq_T + 1] - cu_q_lens_B1[seq_T]
    pos_T = kv_lens_B[seq_T] - q_len_T + (t_T - cu_q_lens_B1[seq_T])
    return seq_T, pos_T, valid_T


def _reference_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                    cu_q_lens_B1, *, sm_scale, sliding_window):
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    _, block_size, num_kv_heads, _ = k_cache_PSKH.shape
    group = num_q_heads // num_kv_heads
    seq_T, pos_T, valid_T = _token_metadata(kv_lens_B, cu_q_lens_B1, num_tokens)
    q_TKGH = q_TNH.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    block_ids_TM = block_tables_BM[seq_T]
    offsets_S = jnp.arange(block_size, dtype=jnp.int32)

    def step(carry, m):
        max_TKG, denom_TKG, acc_TKGH = carry
        key_pos_S = m * block_size + offsets_S
        # Gather this block of every row's own sequence: [T, S, K, H].
        k_TSKH = k_cache_PSKH[block_ids_TM[:, m]].astype(jnp.float32)
        v_TSKH = v_cache_PSKH[block_ids_TM[:, m]].astype(jnp.float32)
        mask_TS = (key_pos_S[None, :] <= pos_T[:, None]) & valid_T[:, None]
        if sliding_window is not None:
            mask_TS &= key_pos_S[None, :] > pos_T[:, None] - sliding_window
        # Masked-off keys may hold garbage (NaN): keep it out of both products.
        k_TSKH = jnp.where(mask_TS[:, :, None, None], k_TSKH, 0.0)
        v_TSKH = jnp.where(mask_TS[:, :, None, None], v_TSKH, 0.0)
        s_TKGS = jnp.einsum("tkgh,tskh->tkgs", q_TKGH, k_TSKH,
                            precision=jax.lax.Precision.HIGHEST) * sm_scale
        s_TKGS = jnp.where(mask_TS[:, None, None, :], s_TKGS, -jnp.inf)
        new_max_TKG = jnp.maximum(max_TKG, s_TKGS.max(axis=-1))
        p_TKGS = jnp.exp(s_TKGS - new_max_TKG[..., None])
        alpha_TKG = jnp.exp(max_TKG - new_max_TKG)
        denom_TKG = denom_TKG * alpha_TKG + p_TKGS.sum(axis=-1)
        acc_TKGH = acc_TKGH * alpha_TKG[..., None] + jnp.einsum(
            "tkgs,tskh->tkgh", p_TKGS, v_TSKH, precision=jax.lax.Precision.HIGHEST)
        return (new_max_TKG, denom_TKG, acc_TKGH), None

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _M_INIT, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    num_blocks_per_seq = block_tables_BM.shape[1]
    (_, denom_TKG, acc_TKGH), _ = jax.lax.scan(
        step, init, jnp.arange(num_blocks_per_seq, dtype=jnp.int32))
    safe_denom_TKG = jnp.where(denom_TKG > 0, denom_TKG, 1.0)
    out_TKGH = acc_TKGH / safe_denom_TKG[..., None]
    out_TNH = out_TKGH.reshape(num_tokens, num_q_heads, head_dim)
    out_TNH = jnp.where(valid_T[:, None, None], out_TNH, 0.0)
    return out_TNH.astype(q_TNH.dtype)


# --------------------------------------------------------------------------
# Dense reference (jnp) for derivatives: every sequence's K/V gathered once
# --------------------------------------------------------------------------
def _gather_keys(k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM):
    """Each sequence's K/V from its block table, packed as C = B * M * S keys [C, K, H] in float32, with each
    key's sequence and position. Keys past their sequence's context are zeroed: the blocks there may hold
    anything (padding writes, another sequence's data, NaN), which must reach neither product."""
    _, block_size, num_kv_heads, head_dim = k_cache_PSKH.shape
    num_seqs, width = block_tables_BM.shape
    keys_per_seq = width * block_size
    key_seq_C = jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), keys_per_seq)
    key_pos_C = jnp.tile(jnp.arange(keys_per_seq, dtype=jnp.int32), num_seqs)
    live_C1 = (key_pos_C < kv_lens_B[key_seq_C])[:, None, None]

    def gather(cache_PSKH):
        kv_CKH = cache_PSKH[block_tables_BM].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        return jnp.where(live_C1, kv_CKH, 0.0)
    return gather(k_cache_PSKH), gather(v_cache_PSKH), key_seq_C, key_pos_C


def _dense_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                *, sm_scale, sliding_window):
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    num_kv_heads = k_cache_PSKH.shape[2]
    seq_T, pos_T, valid_T = _token_metadata(kv_lens_B, cu_q_lens_B1, num_tokens)
    k_CKH, v_CKH, key_seq_C, key_pos_C = _gather_keys(k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM)
    mask_TC = ((key_seq_C[None, :] == seq_T[:, None]) & (key_pos_C[None, :] <= pos_T[:, None])
               & valid_T[:, None])
    if sliding_window is not None:
        mask_TC &= key_pos_C[None, :] > pos_T[:, None] - sliding_window
    q_TKGH = q_TNH.astype(jnp.float32).reshape(num_tokens, num_kv_heads, -1, head_dim)
    s_TKGC = jnp.einsum("tkgh,ckh->tkgc", q_TKGH, k_CKH, precision=jax.lax.Precision.HIGHEST) * sm_scale
    s_TKGC = jnp.where(mask_TC[:, None, None, :], s_TKGC, -jnp.inf)
    # softmax is shift invariant: the max needs no derivative (and _M_INIT keeps key-less rows finite).
    max_TKG = jax.lax.stop_gradient(jnp.maximum(s_TKGC.max(axis=-1), _M_INIT))
    p_TKGC = jnp.exp(s_TKGC - max_TKG[..., None])
    denom_TKG = p_TKGC.sum(axis=-1)
    acc_TKGH = jnp.einsum("tkgc,ckh->tkgh", p_TKGC, v_CKH, precision=jax.lax.Precision.HIGHEST)
    out_TKGH = acc_TKGH / jnp.where(denom_TKG > 0, denom_TKG, 1.0)[..., None]
    out_TNH = jnp.where(valid_T[:, None, None], out_TKGH.reshape(num_tokens, num_q_heads, head_dim), 0.0)
    return out_TNH.astype(q_TNH.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window"))
def ragged_paged_attention_dense_reference(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale: float, sliding_window: int | None = None,
):
    """The reference's values from dense masked scores: each sequence's K/V gathered once from its block
    table, then one [T, N, C] score matrix over the C = B * M * S keys of the step (a token's own
    sequence's keys unmasked). For derivatives (lmjax.layers.attention): the scan of
    `ragged_paged_attention_reference` copies each block per query token, and its jvp / grad keep every
    copy (T * L * K * H floats a layer), where this keeps the T * N * C scores of dense attention."""
    validate_ragged_paged_attention(
        q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
        sm_scale=sm_scale, sliding_window=sliding_window)
    return _dense_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                       sm_scale=sm_scale, sliding_window=sliding_window)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window"))
def ragged_paged_attention_reference(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale: float, sliding_window: int | None = None,
):
    """jnp reference: float32 softmax, output in q's dtype. Same contract as the op."""
    validate_ragged_paged_attention(
        q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
        sm_scale=sm_scale, sliding_window=sliding_window)
    return _reference_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                           cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window)
