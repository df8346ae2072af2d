"""Ragged paged attention's Pallas (Triton backend) kernel and its static tiling.

Shape letters and semantics: pallas_kernels/ragged_paged_attention.py. Rows of a q tile are (token,
head-of-group) pairs, so GQA groups share one K/V stream; grid = (q tiles, kv heads, kv splits).
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas_util import _div, _masked_load, _masked_store, _next_pow2, _num_sms, _on_gpu, _rem
from pallas_kernels._pallas_util import _triton_compiler_params
from pallas_kernels._validate import is_power_of_two, require
from pallas_kernels.kv_tiles import channel_parts, dot_dtype, kv_bits, kv_operands, load_kv_tile, num_kv_refs
from pallas_kernels.ragged_paged_attention_reference import _M_INIT, _token_metadata, validate_ragged_paged_attention

_LOG2E = 1.4426950408889634
TUNABLES = ("block_m", "block_n", "num_splits", "num_warps", "num_stages")


# --------------------------------------------------------------------------
# Static tiling
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------
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


def _attention_kernel(
    kv_lens_B_ref,    # [B] int32
    cu_q_lens_B1_ref, # [B+1] int32
    block_tables_BM_ref,  # [B, M] int32
    q_XH_ref,         # [T*N, H]: q with tokens and heads flattened
    *refs,            # K then V: [P*S, K, H] each, or (codes, scale, zero) each for a quantized cache
                      # (pallas_kernels/kv_tiles.py); then o [T*N, H] (one split) or o [X, T*N, H] f32
                      # and lse [X, T*N] f32
    num_seqs, num_q_heads, group, block_m, block_q, block_n, block_size, scale_log2,
    sliding_window, num_splits, skip_q_len, aliased, bits,
):
    n_kv = num_kv_refs(bits)
    k_refs, v_refs, out_refs = refs[:n_kv], refs[n_kv:2 * n_kv], refs[2 * n_kv:]
    if aliased:  # o arrives as an input too (the same buffer): its rows of skipped sequences stay
        out_refs = out_refs[1:]
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_XH_ref.shape[1]
    seq, q_start, q_count = _tile_of_program(
        cu_q_lens_B1_ref, tile, num_seqs, q_XH_ref.shape[0] // num_q_heads, block_q)
    h_1H = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    chans = channel_parts(head_dim, bits)  # [1, W] channels of each part's dot
    r_R = jnp.arange(block_m, dtype=jnp.int32)
    tok_R = _div(r_R, group)
    row_valid_R = tok_R < q_count
    # Rows are (token, head of this kv head's group) pairs. Masked rows get an
    # out-of-bounds index: never touched on the GPU, and interpret mode drops
    # their scatter instead of racing a real row.
    row_R = (q_start + tok_R) * num_q_heads + kv_head * group + _rem(r_R, group)
    row_R = jnp.where(row_valid_R, row_R, q_XH_ref.shape[0])
    is_padding = seq == num_seqs
    attend = (q_count > 0) & jnp.logical_not(is_padding)
    if skip_q_len is not None:  # sequences this long are another kernel's (ragged_paged_prefill_mgpu)
        seq_c = jnp.minimum(seq, num_seqs - 1)
        attend &= cu_q_lens_B1_ref[seq_c + 1] - cu_q_lens_B1_ref[seq_c] < skip_q_len

    if num_splits == 1:
        (o_XH_ref,) = out_refs

        @pl.when((q_count > 0) & is_padding)
        def _zero_padding_rows():
            zeros_RH = jnp.zeros((block_m, head_dim), o_XH_ref.dtype)
            _masked_store(o_XH_ref.at[row_R[:, None], h_1H], zeros_RH, row_valid_R[:, None])

    @pl.when(attend)
    def _attend():
        seq_q_start = cu_q_lens_B1_ref[seq]
        q_len = cu_q_lens_B1_ref[seq + 1] - seq_q_start
        pos0 = kv_lens_B_ref[seq] - q_len + (q_start - seq_q_start)  # first query's position
        pos_R = pos0 + tok_R
        # Interpret mode cannot mix array indices with slices: index every axis
        # with (broadcastable) arrays. Triton gets the same pointer arithmetic.
        dtype = dot_dtype(q_XH_ref.dtype, bits)
        q_parts = [_masked_load(q_XH_ref.at[row_R[:, None], c_1W], row_valid_R[:, None], 0.0).astype(dtype)
                   for c_1W in chans]

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
        tile_kw = dict(bits=bits, head_dim=head_dim, dtype=dtype)

        def body(kv_tile, carry, masked):
            max_R, denom_R, accs = carry
            key_C = kv_tile * block_n + c_C
            if masked:
                key_valid_C = (key_C < hi) & (key_C >= lo)
                block_C = _masked_load(
                    block_tables_BM_ref.at[seq, jnp.where(key_valid_C, _div(key_C, block_size), 0)],
                    key_valid_C, 0)
                slot_C = jnp.where(key_valid_C, block_C * block_size + _rem(key_C, block_size), 0)
            else:
                key_valid_C = None
                block_C = block_tables_BM_ref[seq, _div(key_C, block_size)]
                slot_C = block_C * block_size + _rem(key_C, block_size)
            # Masked-off keys are never read: unwritten slots may hold NaN.
            k_parts, k_scale_C = load_kv_tile(k_refs, slot_C, kv_head, key_valid_C, **tile_kw)
            v_parts, v_scale_C = load_kv_tile(v_refs, slot_C, kv_head, key_valid_C, **tile_kw)
            s_RC = functools.reduce(operator.add, (  # one part, or int4's two (no "0 +" on the float path)
                jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for q, k in zip(q_parts, k_parts)))
            if bits is not None:  # q . k = scale * (q . (code - zero))
                s_RC = s_RC * k_scale_C[None, :]
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
            ref = None
            if bits is None:
                w_RC = p_RC.astype(v_parts[0].dtype)
            else:  # sum_c p_c v_c = ref (w . (code - zero)) with w = p scale / ref; ref = the tile's largest
                # scale keeps w in [0, 1] (no float16 underflow)
                ref = jnp.max(v_scale_C)
                ref = jnp.where(ref > 0, ref, 1.0)
                w_RC = (p_RC * (v_scale_C / ref)[None, :]).astype(dtype)

            def pv(v_CW):
                pv_RW = jax.lax.dot_general(w_RC, v_CW, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                return pv_RW if ref is None else ref * pv_RW
            accs = tuple(acc * alpha_R[:, None] + pv(v) for acc, v in zip(accs, v_parts))
            return new_max_R, denom_R, accs

        carry = (jnp.full((block_m,), _M_INIT, jnp.float32),
                 jnp.zeros((block_m,), jnp.float32),
                 tuple(jnp.zeros((block_m, c.shape[1]), jnp.float32) for c in chans))
        masked_body = functools.partial(body, masked=True)
        carry = jax.lax.fori_loop(start, inner_lo, masked_body, carry)
        carry = jax.lax.fori_loop(inner_lo, inner_hi, functools.partial(body, masked=False), carry)
        max_R, denom_R, accs = jax.lax.fori_loop(inner_hi, stop, masked_body, carry)
        has_keys_R = denom_R > 0
        denom_R1 = jnp.where(has_keys_R, denom_R, 1.0)[:, None]
        row_valid_R1 = row_valid_R[:, None]
        if num_splits == 1:
            (o_XH_ref,) = out_refs
            for acc, c_1W in zip(accs, chans):
                _masked_store(o_XH_ref.at[row_R[:, None], c_1W], (acc / denom_R1).astype(o_XH_ref.dtype),
                              row_valid_R1)
        else:
            o_VXH_ref, lse_VX_ref = out_refs
            lse_R = jnp.where(has_keys_R, max_R + jnp.log2(jnp.where(has_keys_R, denom_R, 1.0)),
                              -jnp.inf)
            for acc, c_1W in zip(accs, chans):
                _masked_store(o_VXH_ref.at[split, row_R[:, None], c_1W], acc / denom_R1, row_valid_R1)
            _masked_store(lse_VX_ref.at[split, row_R], lse_R, row_valid_R)


def _combine_splits(o_VXH, lse_VX):
    """Merge per-split normalized outputs by their log2-sum-exp weights."""
    lse_max_X = jnp.max(lse_VX, axis=0)
    safe_max_X = jnp.where(jnp.isfinite(lse_max_X), lse_max_X, 0.0)
    w_VX = jnp.exp2(lse_VX - safe_max_X[None])
    w_VX = jnp.where(jnp.isfinite(lse_VX), w_VX, 0.0)
    total_X = jnp.sum(w_VX, axis=0)
    # A weighted sum, not an einsum: XLA then fuses the weights, the sum, the division and the caller's
    # mask and cast into one reduction kernel (an einsum is a dot of its own plus a convert a layer).
    weighted_VXH = jnp.where(w_VX[..., None] > 0, w_VX[..., None] * o_VXH, 0.0)
    return jnp.sum(weighted_VXH, axis=0) / jnp.where(total_X > 0, total_X, 1.0)[:, None]


def _kernel_impl(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                 *, sm_scale, sliding_window, interpret, config=None, skip_q_len=None, into_TNH=None):
    """The Triton kernel over every row, or with skip_q_len only over sequences with fewer query rows:
    the rows of the others come from into_TNH (written by another kernel), unchanged. The caches are
    float arrays or `QuantKV` (lmjax's int4: K stored mapped, so q comes mapped too)."""
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    _, block_size, num_kv_heads, _ = k_cache_PSKH.shape
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
    aliased = into_TNH is not None and num_splits == 1  # write into the other kernel's output in place
    kernel = functools.partial(
        _attention_kernel, num_seqs=num_seqs, num_q_heads=num_q_heads, group=num_q_heads // num_kv_heads,
        block_m=cfg["block_m"], block_q=cfg["block_q"], block_n=cfg["block_n"], block_size=block_size,
        scale_log2=float(sm_scale) * _LOG2E, sliding_window=sliding_window,
        num_splits=num_splits, skip_q_len=skip_q_len, aliased=aliased, bits=kv_bits(k_cache_PSKH))
    operands = [kv_lens_B, cu_q_lens_B1, block_tables_BM, q_TNH.reshape(rows, head_dim),
                *kv_operands(k_cache_PSKH), *kv_operands(v_cache_PSKH)]
    aliases = {len(operands): 0} if aliased else {}
    if aliased:
        operands.append(into_TNH.reshape(rows, head_dim))
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(cfg["num_tiles"], num_kv_heads, num_splits),
        compiler_params=_triton_compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        input_output_aliases=aliases,
        name="ragged_paged_attention",
    )(*operands)
    if num_splits == 1:  # the kernel wrote every row (padding zeros included) or left into_TNH's
        return outs.reshape(num_tokens, num_q_heads, head_dim)
    out_TNH = _combine_splits(*outs).reshape(num_tokens, num_q_heads, head_dim)
    seq_T, _, valid_T = _token_metadata(kv_lens_B, cu_q_lens_B1, num_tokens)
    out_TNH = jnp.where(valid_T[:, None, None], out_TNH, 0).astype(q_TNH.dtype)
    if into_TNH is None:
        return out_TNH
    long_T = (cu_q_lens_B1[seq_T + 1] - cu_q_lens_B1[seq_T] >= skip_q_len) & valid_T
    return jnp.where(long_T[:, None, None], into_TNH, out_TNH)


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
