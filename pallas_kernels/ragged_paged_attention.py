"""Ragged paged attention: one op for a batch mixing decode rows and prefill chunks.

Shape letters (used as suffixes of every array name in this module):
  T  tokens in the step (padded)         N  query heads
  K  kv heads                            G  query heads per kv head (N // K)
  H  head dim                            P  cache blocks
  S  block size (tokens per block)       B  sequences (padded)
  M  max blocks per sequence             L  max context (M * S)
  V  kv splits (grid axis 2)             X  rows of q flattened (T * N)
  Z  cache slots flattened (P * S)       R  rows of a q tile (block_m)
  C  keys of a kv tile (block_n)         Q  tokens of a q tile (block_q)
  A  sequences and the padding pseudo-sequence (B + 1), padded to a power of two
  1  a broadcast axis of size one

Sequence b owns query rows cu_q_lens[b] .. cu_q_lens[b+1]-1 of q. Its context
after this step is kv_lens[b] tokens; query i of the sequence sits at absolute
position kv_lens[b] - q_len + i and attends keys j <= position (and
j > position - sliding_window when a window is set: HF Mistral semantics).
Key j of sequence b lives at k_cache[block_tables[b, j // S], j % S].

Three entry points:
  ragged_paged_attention            public op; impl="auto" -> kernel on GPU,
                                    reference elsewhere
  ragged_paged_attention_kernel     Pallas (Triton backend) kernel
  ragged_paged_attention_reference  jnp reference (the CPU production path)
Both implementations go through `validate_ragged_paged_attention`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._validate import (
    is_power_of_two,
    require,
    require_dim,
    require_dtype,
    require_rank,
)

try:  # The Triton backend module; absent from some jax builds.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plgpu = None

IMPLS = ("auto", "kernel", "reference", "tiled")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Finite stand-in for -inf in the running max: exp2(-inf - (-inf)) would be NaN
# for rows that have seen no key yet, exp2(-inf - _M_INIT) is 0.
_M_INIT = -1e30
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------
# jax version compatibility (0.10.2 on CPU, 0.11.2 on GPU)
# --------------------------------------------------------------------------
def _triton_compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params under whichever name this jax spells them."""
    for owner, name in ((plgpu, "CompilerParams"), (plgpu, "TritonCompilerParams"),
                        (pl, "TritonCompilerParams")):
        cls = getattr(owner, name, None) if owner is not None else None
        if cls is not None:
            return cls(num_warps=num_warps, num_stages=num_stages)
    return None


def _masked_load(ref, mask, other):
    """Load with a mask; `other` fills the masked-off elements (no memory access)."""
    if plgpu is not None and hasattr(plgpu, "load"):
        return plgpu.load(ref, mask=mask, other=other)
    return pl.load(ref, None, mask=mask, other=other)  # older jax spelling


def _masked_store(ref, val, mask):
    if plgpu is not None and hasattr(plgpu, "store"):
        return plgpu.store(ref, val, mask=mask)
    return pl.store(ref, None, val, mask=mask)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", 0) or 132


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
    require(impl in IMPLS, f"impl={impl!r} must be one of {IMPLS}")
    if for_kernel:
        # Triton tiles need power-of-two extents.
        require(
            is_power_of_two(head_dim) and 16 <= head_dim <= 256,
            f"head_dim={head_dim} must be a power of two in [16, 256] for the kernel",
        )


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


# --------------------------------------------------------------------------
# Kernel (Pallas, Triton backend)
# --------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


TUNABLES = ("block_m", "block_n", "num_splits", "num_warps", "num_stages")


def _num_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """q tiles of block_q tokens that cover any ragged batch: each tile has >= 1 row, and with the
    padding pseudo-sequence sum_b cdiv(q_b, Q) <= (T + (B + 1) (Q - 1)) / Q."""
    return max(1, min(num_tokens, (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q))


def _choose_config(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                   max_context, on_gpu, **overrides):
    """Static tiling from static shapes only (contents are traced).

    Rows of a q tile are (token, head-of-group) pairs, so GQA groups share one
    K/V stream. The expected query rows per sequence (T / B) sizes the tile:
    decode batches (T ~ B) get 16-row tiles, prefill chunks 64-row tiles (or
    more when one GQA group is wider). `overrides` (keys in TUNABLES) replace the
    heuristic choices; the derived fields follow from them.
    """
    require(set(overrides) <= set(TUNABLES), f"config keys={sorted(overrides)} must be in {TUNABLES}")
    group = num_q_heads // num_kv_heads
    rows_per_seq = group * -(-num_tokens // max(num_seqs, 1))
    block_m = max(min(64, max(16, _next_pow2(rows_per_seq))), _next_pow2(group))
    # Measured on an H200 (BENCHMARKS.md, tiling sweeps): decode wants long kv
    # tiles and 2 stages (bytes in flight without starving occupancy of shared
    # memory); prefill 64-row q tiles with short kv tiles.
    # Rows of tiles times kv heads, before any context split: how many programs fill the GPU.
    many_programs = _num_tiles(num_tokens, num_seqs, max(1, block_m // group)) * num_kv_heads >= 4 * _num_sms()
    if block_m <= 32:
        # Thousands of decode programs (batch ~1,000): shorter kv tiles keep more of them resident
        # (H200, batch 1024 x context 256: 93% vs 82% of copy bandwidth with 128-key tiles).
        cfg = dict(block_m=block_m, block_n=64 if many_programs else 128, num_warps=4, num_stages=2)
    elif head_dim > 64:
        cfg = dict(block_m=block_m, block_n=32, num_warps=4, num_stages=2)
    else:
        cfg = dict(block_m=block_m, block_n=64, num_warps=4, num_stages=3)
    cfg.update({k: v for k, v in overrides.items() if k != "num_splits"})
    block_m = cfg["block_m"]
    require(block_m >= group and is_power_of_two(block_m),
            f"block_m={block_m} must be a power of two >= group={group}")
    block_q = max(1, block_m // group)
    num_tiles = _num_tiles(num_tokens, num_seqs, block_q)
    # Split the context (flash-decoding) only when q tiles alone cannot fill the GPU; up to 8 splits of
    # >= 1 kv tile (H200, batch 1: 8B heads at context 512 take 5.8 us with 4 splits vs 9.5 us unsplit,
    # context 2048 8.9 us with 8 vs 10.7 with 4; more splits cost more in the combine).
    programs = num_tiles * num_kv_heads
    kv_tiles = -(-max_context // cfg["block_n"])
    num_splits = max(1, min(2 * _num_sms() // programs, kv_tiles, 8)) if on_gpu else 1
    cfg["num_splits"] = overrides.get("num_splits", num_splits)
    return dict(cfg, block_q=block_q, num_tiles=num_tiles)


def _tile_of_program(cu_q_lens_B1_ref, tile, num_seqs, num_tokens, block_q):
    """This q tile's (sequence, first row of q, rows it holds; 0 = idle tile).

    Sequence b owns cdiv(q_len_b, Q) consecutive tiles. Padding rows
    cu_q_lens[-1] .. T-1 form a pseudo-sequence B, so that the kernel writes
    their zeros itself. Computed in every program from the [B+1] vector (a
    cumsum over a few hundred lanes) instead of by separate XLA kernels, whose
    launches cost more than this on the decode path.
    """
    b_A = jnp.arange(_next_pow2(num_seqs + 1), dtype=jnp.int32)
    in_A = b_A <= num_seqs
    start_A = _masked_load(cu_q_lens_B1_ref.at[jnp.minimum(b_A, num_seqs)], in_A, num_tokens)
    stop_A = _masked_load(cu_q_lens_B1_ref.at[jnp.minimum(b_A + 1, num_seqs)],
                          b_A < num_seqs, num_tokens)
    tiles_A = _div(stop_A - start_A + block_q - 1, block_q)
    tile_end_A = jnp.cumsum(tiles_A)
    seq = jnp.sum((tile_end_A <= tile).astype(jnp.int32))
    this_A = b_A == seq
    first_tile = jnp.sum(jnp.where(this_A, tile_end_A - tiles_A, 0))
    q_start = jnp.sum(jnp.where(this_A, start_A, 0)) + (tile - first_tile) * block_q
    q_stop = jnp.sum(jnp.where(this_A, stop_A, 0))
    q_count = jnp.where(seq <= num_seqs, jnp.clip(q_stop - q_start, 0, block_q), 0)
    return seq, q_start, q_count


def _div(x, d: int):
    """Division of non-negative ints: lax.div, not jnp's floor division, which
    adds sign fix-ups that the Triton lowering may not support."""
    return jax.lax.div(x, jnp.asarray(d, jnp.int32)) if not isinstance(x, int) else x // d


def _rem(x, d: int):
    return jax.lax.rem(x, jnp.asarray(d, jnp.int32))


def _attention_kernel(
    kv_lens_B_ref,    # [B] int32
    cu_q_lens_B1_ref, # [B+1] int32
    block_tables_BM_ref,  # [B, M] int32
    q_XH_ref,         # [T*N, H]: q with tokens and heads flattened
    k_ZKH_ref,        # [P*S, K, H]: cache with blocks and slots flattened
    v_ZKH_ref,        # [P*S, K, H]
    *out_refs,        # o [T*N, H] (one split) or o [X, T*N, H] f32 and lse [X, T*N] f32
    num_seqs, num_q_heads, group, block_m, block_q, block_n, block_size, scale_log2,
    sliding_window, num_splits,
):
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_XH_ref.shape[1]
    seq, q_start, q_count = _tile_of_program(
        cu_q_lens_B1_ref, tile, num_seqs, q_XH_ref.shape[0] // num_q_heads, block_q)
    h_1H = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    r_R = jnp.arange(block_m, dtype=jnp.int32)
    tok_R = _div(r_R, group)
    row_valid_R = tok_R < q_count
    # Rows are (token, head of this kv head's group) pairs. Masked rows get an
    # out-of-bounds index: never touched on the GPU, and interpret mode drops
    # their scatter instead of racing a real row.
    row_R = (q_start + tok_R) * num_q_heads + kv_head * group + _rem(r_R, group)
    row_R = jnp.where(row_valid_R, row_R, q_XH_ref.shape[0])
    is_padding = seq == num_seqs

    if num_splits == 1:
        (o_XH_ref,) = out_refs

        @pl.when((q_count > 0) & is_padding)
        def _zero_padding_rows():
            zeros_RH = jnp.zeros((block_m, head_dim), o_XH_ref.dtype)
            _masked_store(o_XH_ref.at[row_R[:, None], h_1H], zeros_RH, row_valid_R[:, None])

    @pl.when((q_count > 0) & jnp.logical_not(is_padding))
    def _attend():
        seq_q_start = cu_q_lens_B1_ref[seq]
        q_len = cu_q_lens_B1_ref[seq + 1] - seq_q_start
        pos0 = kv_lens_B_ref[seq] - q_len + (q_start - seq_q_start)  # first query's position
        pos_R = pos0 + tok_R
        # Interpret mode cannot mix array indices with slices: index every axis
        # with (broadcastable) arrays. Triton gets the same pointer arithmetic.
        q_RH = _masked_load(q_XH_ref.at[row_R[:, None], h_1H], row_valid_R[:, None], 0.0)

        # Keys of the tile: [lo, hi). Keys in [full_lo, pos0] are visible to
        # every row, so kv tiles inside it skip all masking.
        hi = pos0 + q_count
        if sliding_window is None:
            lo = full_lo = 0
        else:
            lo = jnp.maximum(pos0 - sliding_window + 1, 0)
            full_lo = jnp.maximum(hi - sliding_window, 0)
        first_tile = _div(lo, block_n)
        num_kv_tiles = _div(hi + block_n - 1, block_n) - first_tile
        per_split = _div(num_kv_tiles + num_splits - 1, num_splits)
        start = first_tile + split * per_split
        stop = jnp.minimum(start + per_split, first_tile + num_kv_tiles)
        inner_lo = jnp.clip(_div(full_lo + block_n - 1, block_n), start, stop)
        inner_hi = jnp.clip(_div(pos0 + 1, block_n), inner_lo, stop)
        c_C = jnp.arange(block_n, dtype=jnp.int32)

        def body(kv_tile, carry, masked):
            max_R, denom_R, acc_RH = carry
            key_C = kv_tile * block_n + c_C
            if masked:
                key_valid_C = (key_C < hi) & (key_C >= lo)
                block_C = _masked_load(
                    block_tables_BM_ref.at[seq, jnp.where(key_valid_C, _div(key_C, block_size), 0)],
                    key_valid_C, 0)
                slot_C = jnp.where(key_valid_C, block_C * block_size + _rem(key_C, block_size), 0)
                # Masked-off keys are never read: unwritten slots may hold NaN.
                k_CH = _masked_load(k_ZKH_ref.at[slot_C[:, None], kv_head, h_1H],
                                    key_valid_C[:, None], 0.0)
                v_CH = _masked_load(v_ZKH_ref.at[slot_C[:, None], kv_head, h_1H],
                                    key_valid_C[:, None], 0.0)
            else:
                block_C = block_tables_BM_ref[seq, _div(key_C, block_size)]
                slot_C = block_C * block_size + _rem(key_C, block_size)
                k_CH = k_ZKH_ref[slot_C[:, None], kv_head, h_1H]
                v_CH = v_ZKH_ref[slot_C[:, None], kv_head, h_1H]
            s_RC = jax.lax.dot_general(
                q_RH, k_CH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s_RC = s_RC * scale_log2
            if masked:
                mask_RC = (key_C[None, :] <= pos_R[:, None]) & key_valid_C[None, :]
                if sliding_window is not None:
                    mask_RC &= key_C[None, :] > pos_R[:, None] - sliding_window
                s_RC = jnp.where(mask_RC, s_RC, -jnp.inf)
            new_max_R = jnp.maximum(max_R, jnp.max(s_RC, axis=1))
            p_RC = jnp.exp2(s_RC - new_max_R[:, None])
            alpha_R = jnp.exp2(max_R - new_max_R)
            denom_R = denom_R * alpha_R + jnp.sum(p_RC, axis=1)
            pv_RH = jax.lax.dot_general(
                p_RC.astype(v_CH.dtype), v_CH, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)
            acc_RH = acc_RH * alpha_R[:, None] + pv_RH
            return new_max_R, denom_R, acc_RH

        carry = (jnp.full((block_m,), _M_INIT, jnp.float32),
                 jnp.zeros((block_m,), jnp.float32),
                 jnp.zeros((block_m, head_dim), jnp.float32))
        masked_body = functools.partial(body, masked=True)
        carry = jax.lax.fori_loop(start, inner_lo, masked_body, carry)
        carry = jax.lax.fori_loop(inner_lo, inner_hi, functools.partial(body, masked=False), carry)
        max_R, denom_R, acc_RH = jax.lax.fori_loop(inner_hi, stop, masked_body, carry)
        has_keys_R = denom_R > 0
        out_RH = acc_RH / jnp.where(has_keys_R, denom_R, 1.0)[:, None]
        if num_splits == 1:
            (o_XH_ref,) = out_refs
            _masked_store(o_XH_ref.at[row_R[:, None], h_1H], out_RH.astype(o_XH_ref.dtype),
                          row_valid_R[:, None])
        else:
            o_VXH_ref, lse_VX_ref = out_refs
            lse_R = jnp.where(has_keys_R, max_R + jnp.log2(jnp.where(has_keys_R, denom_R, 1.0)),
                              -jnp.inf)
            _masked_store(o_VXH_ref.at[split, row_R[:, None], h_1H], out_RH, row_valid_R[:, None])
            _masked_store(lse_VX_ref.at[split, row_R], lse_R, row_valid_R)


def _combine_splits(o_VXH, lse_VX):
    """Merge per-split normalized outputs by their log2-sum-exp weights."""
    lse_max_X = jnp.max(lse_VX, axis=0)
    safe_max_X = jnp.where(jnp.isfinite(lse_max_X), lse_max_X, 0.0)
    w_VX = jnp.exp2(lse_VX - safe_max_X[None])
    w_VX = jnp.where(jnp.isfinite(lse_VX), w_VX, 0.0)
    total_X = jnp.sum(w_VX, axis=0)
    out_XH = jnp.einsum("vx,vxh->xh", w_VX, jnp.where(w_VX[..., None] > 0, o_VXH, 0.0))
    return out_XH / jnp.where(total_X > 0, total_X, 1.0)[:, None]


def _kernel_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                 *, sm_scale, sliding_window, interpret, config=None):
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache_PSKH.shape
    num_seqs, max_blocks = block_tables_BM.shape
    cfg = _choose_config(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                         max_blocks * block_size, on_gpu=not interpret and _on_gpu(),
                         **(config or {}))
    num_splits = cfg["num_splits"]
    rows = num_tokens * num_q_heads
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows, head_dim), q_TNH.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, rows), jnp.float32))
    kernel = functools.partial(
        _attention_kernel, num_seqs=num_seqs, num_q_heads=num_q_heads, group=num_q_heads // num_kv_heads,
        block_m=cfg["block_m"], block_q=cfg["block_q"], block_n=cfg["block_n"], block_size=block_size,
        scale_log2=float(sm_scale) * _LOG2E, sliding_window=sliding_window,
        num_splits=num_splits)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(cfg["num_tiles"], num_kv_heads, num_splits),
        compiler_params=_triton_compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="ragged_paged_attention",
    )(kv_lens_B, cu_q_lens_B1, block_tables_BM,
      q_TNH.reshape(rows, head_dim),
      k_cache_PSKH.reshape(num_blocks * block_size, num_kv_heads, head_dim),
      v_cache_PSKH.reshape(num_blocks * block_size, num_kv_heads, head_dim))
    if num_splits == 1:  # the kernel wrote every row, padding zeros included
        return outs.reshape(num_tokens, num_q_heads, head_dim)
    out_TNH = _combine_splits(*outs).reshape(num_tokens, num_q_heads, head_dim)
    valid_T = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens_B1[-1]
    return jnp.where(valid_T[:, None, None], out_TNH, 0).astype(q_TNH.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "interpret", "config"))
def _kernel_jit(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                *, sm_scale, sliding_window, interpret, config):
    return _kernel_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                        cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window,
                        interpret=interpret, config=None if config is None else dict(config))


def ragged_paged_attention_kernel(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale: float, sliding_window: int | None = None, interpret: bool = False,
    config: dict | None = None,
):
    """Pallas kernel; `config` (keys in TUNABLES) overrides the tiling heuristic."""
    validate_ragged_paged_attention(
        q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
        sm_scale=sm_scale, sliding_window=sliding_window, for_kernel=True)
    frozen = None if config is None else tuple(sorted(config.items()))
    return _kernel_jit(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                       cu_q_lens_B1, sm_scale=float(sm_scale), sliding_window=sliding_window,
                       interpret=interpret, config=frozen)


# --------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------
def ragged_paged_attention(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale: float, sliding_window: int | None = None, impl: str = "auto",
    interpret: bool = False,
):
    """Attention of a ragged batch of queries over a paged KV cache.

    impl: "auto" runs the Pallas kernel on GPU and the XLA tiled version
    (ragged_paged_attention_tiled.py) elsewhere; "kernel" / "reference" / "tiled" force one. interpret=True runs the kernel in Pallas
    interpret mode (any backend; tests). Returns out_TNH in q's dtype, with
    rows past cu_q_lens[-1] zero.
    """
    validate_ragged_paged_attention(
        q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
        sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
    use_kernel = impl == "kernel" or (impl == "auto" and (interpret or _on_gpu()))
    args = (q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1)
    if use_kernel:
        return ragged_paged_attention_kernel(*args, sm_scale=sm_scale, sliding_window=sliding_window,
                                             interpret=interpret)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, sm_scale=sm_scale, sliding_window=sliding_window)
    # Off GPU, production runs the XLA version that skips blocks no query can see.
    from pallas_kernels.ragged_paged_attention_tiled import ragged_paged_attention_tiled

    return ragged_paged_attention_tiled(*args, sm_scale=sm_scale, sliding_window=sliding_window)
