"""The w4 matmul's gemv path (decode: T <= GEMV_MAX_T; `w4_matmul_kernel` picks it for T = 1).

Layout, algebra and grid: pallas_kernels/w4_matmul.py. No dot: a program streams wide row-major tiles
[rows, block_o] of packed bytes (block_o contiguous bytes per row, so a warp's loads coalesce into whole
lines), unpacks the nibbles in registers, multiplies them by x broadcast along the output axis and
reduces over the packed rows with a sum, one group (or chunk of a group) at a time; a tile of rows > G/2
is several groups loaded before any is used, so more bytes are in flight. The tokens are a static loop
(each reuses the unpacked tile), so nothing is padded. x is read straight from x_TI (even / odd columns
by stride-2 loads, tiny and cached) and the per-chunk sums of x are taken in the kernel: no XLA ops
before the call. Nibbles become floats by the exponent trick (bits 0x4B000000 | q is the float
2**23 + q; subtract 2**23): two integer ops and a float add instead of an int->float convert, which the
SM issues at a quarter of the FMA rate and which would cap the kernel near 2 TB/s (`unpack="convert"`
keeps the convert to compare). On the GPU with bf16 x the default is `unpack="bf16x2"`: unpack and
products two at a time in packed PTX (pallas_kernels/w4_bf16x2.py), because the float32 path is bound
by its instructions (~1.5 TB/s); measured 1.6x faster a decoder layer. Why not the dot path at T = 1:
it pads x to 16 rows (Triton's dot minimum), so 15/16 of its tensor-core work is padding, and its
[16, G/2] x [G/2, block_o] dots per group leave few bytes in flight: ~1.1 TB/s of 4.3 on an H200.

Shape letters as in w4_matmul.py: J packed rows, O output dim, g groups, B output block, X splits,
T tokens, C packed rows per chunk (a chunk lies inside one group: C = min(rows, G/2)).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas_util import (
    _div,
    _load_masked_if,
    _masked_store,
    _num_sms,
    _on_gpu,
    _triton_compiler_params,
)
from pallas_kernels._validate import require
from pallas_kernels.w4_bf16x2 import CENTER, bf16x2_products

GEMV_TUNABLES = ("block_o", "rows", "num_splits", "num_warps", "num_stages", "unpack", "prefetch")
UNPACKS = ("magic", "convert", "bf16x2")  # bf16x2: pallas_kernels/w4_bf16x2.py, bf16 x only
WIDE_O = 16384  # the bf16x2 tiling's "widest weights" (merged gate/up of 8B-sized models)
GEMV_MAX_T = 4  # the most tokens the gemv path takes (forced); "auto" uses it for T = 1 only
MAGIC_BITS = 0x4B000000  # float32 2**23: OR-ing q < 2**23 into its mantissa gives the float 2**23 + q
MAGIC = 8388608.0


def _choose_gemv_config(J, O, half_group, on_gpu, block_o=None, rows=None, num_splits=None, num_warps=4,
                        num_stages=3, unpack=None, prefetch=False, x_bf16=False):
    """Tiles of `rows` packed rows x block_o bytes. Aim for >= 2 programs per SM (a decode-sized weight
    is a few microseconds of reading: an idle SM is lost bandwidth), with at most J/256 splits (their
    float32 partials, written and read back, stay under ~3% of the packed bytes). block_o starts at
    256 bytes and halves while that target is missed, down to 128 (a whole cache line per row), or
    to 64 while the programs do not even fill one wave. Splits take whole loop iterations,
    preferring a count that divides them (no masked tail)."""
    sms = _num_sms() if on_gpu else 0
    if unpack is None:  # the packed PTX where it runs and x is bf16 (H200: 1.6x the float32 path a layer)
        unpack = "bf16x2" if on_gpu and x_bf16 else "magic"
    if on_gpu and block_o is None and rows is None and num_splits is None and unpack == "bf16x2":
        # Measured (H200, 2026-11-24, .carry sweep of the PTX path, 8B shapes, g128): 4 warps, one group a
        # tile; 512-byte rows, 256 where O <= 1024. Splits re-measured with the weights cold in L2, as
        # in a decode step (session 16, 2026-11-25, H100 and H200 agree; the earlier sweep's weights
        # fit in L2): one tile a split (14336x4096: 112 splits, 14.2 vs 17.6 us at 32 on the H200, 16.8
        # vs 18.8 on the H100), except the widest weights (merged gate/up, 4096x28672), where 8 splits'
        # float32 partials cost less than 32's (24.7 vs 25.6 us H200, 27.2 vs 31.3 H100).
        # A block that divides O: a masked column tail predicates every load of the kernel, measured 2x
        # slower on a vocab-wide lm_head (4096x128256, H100, 2026-11-25: 512-byte rows 230 us, 256 112 us).
        block_o = 256 if O <= 1024 else next((b for b in (512, 256, 128) if O % b == 0), 512)
        rows, num_warps = half_group, 4
        num_splits = 8 if O >= WIDE_O else -(-J // rows)
    elif on_gpu and block_o is None and rows is None and num_splits is None:
        # Measured (H200, 2026-11-23, `w4_matmul_bench.py --tokens 1 --sweep`, 8B shapes, g128): one
        # loop iteration per split. Wide weights: 512-byte rows, 8 warps, 32 splits (4096x14336 24.7 ->
        # 21.1 us); the others: two groups a tile, 16 splits (4096x4096 9.2 -> 8.4, 4096x1024 7.4 -> 4.3 us).
        wide = O >= 8192 or J >= 4096
        block_o, rows, num_splits = (512, half_group, 32) if wide else (128, max(2 * half_group, 2), 16)
        num_warps = 8 if wide else num_warps
    rows = rows or half_group
    iters = -(-J // rows)
    max_splits = max(1, min(iters, J // 256))

    def programs(b):
        return -(-O // b) * max_splits

    if block_o is None:
        block_o = min(256, max(16, 1 << (O - 1).bit_length()))
        while block_o > 128 and programs(block_o) < 2 * sms or block_o > 64 and programs(block_o) < sms:
            block_o //= 2
    o_blocks = -(-O // block_o)
    if num_splits is None:
        want = min(max_splits, -(-2 * sms // o_blocks))
        fits = [d for d in range(1, iters + 1) if iters % d == 0 and want <= iters // d <= max_splits]
        per_split = max(fits) if fits else -(-iters // max(want, 1))
    else:
        per_split = -(-iters // min(num_splits, iters))
    chunk = min(rows, half_group)
    return dict(block_o=block_o, o_blocks=o_blocks, rows=rows, chunk=chunk, unroll=rows // chunk,
                iters_per_split=per_split, num_splits=-(-iters // per_split), iters=iters,
                num_warps=num_warps, num_stages=num_stages, unpack=unpack, prefetch=prefetch)


def _unpack(p_CB, unpack):
    """uint8 [C, B] -> (low, high) nibbles as exact float32."""
    if unpack == "convert":
        return (p_CB & 0xF).astype(jnp.float32), (p_CB >> 4).astype(jnp.float32)
    w_CB = p_CB.astype(jnp.uint32)

    def to_f32(q_CB):  # q < 16: the exponent trick, no int->float convert
        return jax.lax.bitcast_convert_type(q_CB | MAGIC_BITS, jnp.float32) - MAGIC

    return to_f32(w_CB & 0xF), to_f32(w_CB >> 4)


def _gemv_kernel(x_TI_ref,        # [T, I] x's dtype: even / odd columns read by stride-2 loads
                 packed_JO_ref,   # [J, O] uint8
                 scale_gO_ref,    # [g, O]
                 offset_gO_ref,   # [g, O]
                 out_XTO_ref,     # [X, T, O] float32 partials (x's dtype when X = 1)
                 *, T, chunk, unroll, chunks_per_group, iters_per_split, block_o, mask_rows, mask_cols,
                 unpack, prefetch, interpret):
    """One (output block, split): `iters_per_split` tiles of unroll x [chunk, block_o] bytes; each
    chunk is reduced over its rows, scaled by its group's scale and accumulated per token.
    prefetch: tile i + 1's loads are issued before tile i's arithmetic (carried in registers through
    the loop), so a program's bytes stream while it computes instead of in turns with it. Off by
    default: no gain measured (H200, 2026-11-24: the best prefetching config of each 8B shape 6-7%
    slower than one tile a split without it)."""
    ob, split = pl.program_id(0), pl.program_id(1)
    J, O = packed_JO_ref.shape
    groups = scale_gO_ref.shape[0]
    o_B = ob * block_o + jnp.arange(block_o, dtype=jnp.int32)
    col_ok_B = o_B < O
    # Out-of-range indices are clamped (and their loads masked) so interpret mode never reads past
    # the end; the GPU only sees the mask.
    o_B = jnp.where(col_ok_B, o_B, 0) if mask_cols else o_B
    r_C = jnp.arange(chunk, dtype=jnp.int32)

    load = _load_masked_if  # unmasked loads where the shapes allow: no predication in the common (8B) case

    def load_chunk(c):
        """Chunk c's packed tile, its group's scale and offset, its rows' x (even, odd) per token."""
        j_C = c * chunk + r_C
        row_ok_C = j_C < J  # only past the last real chunk (short last group, split tail)
        j_C = jnp.where(row_ok_C, j_C, 0) if mask_rows else j_C
        p_CB = load(packed_JO_ref, (j_C[:, None], o_B[None, :]), row_ok_C[:, None] & col_ok_B[None, :],
                    mask_rows or mask_cols, 0)
        g = jnp.minimum(_div(c, chunks_per_group), groups - 1)  # clamped: tail chunks are all masked
        scale_B = load(scale_gO_ref, (g, o_B), col_ok_B, mask_cols, 0.0).astype(jnp.float32)
        offset_B = load(offset_gO_ref, (g, o_B), col_ok_B, mask_cols, 0.0).astype(jnp.float32)
        x = [tuple(load(x_TI_ref, (t, 2 * j_C + k), row_ok_C, mask_rows, 0.0) for k in (0, 1)) for t in range(T)]
        return p_CB, scale_B, offset_B, x

    def add_chunk(acc_T, tile):
        p_CB, scale_B, offset_B, x = tile
        if unpack == "bf16x2":  # the codes enter centered: q * s + z = (q - 8) * s + (z + 8 * s)
            offset_B = offset_B + CENTER * scale_B
            products = functools.partial(bf16x2_products, p_CB, interpret=interpret)
        else:
            low_CB, high_CB = _unpack(p_CB, unpack)

            def products(xe_C, xo_C):
                return xe_C[:, None].astype(jnp.float32) * low_CB + xo_C[:, None].astype(jnp.float32) * high_CB
        out = []
        for acc_B, (xe_C, xo_C) in zip(acc_T, x):
            # The products before the sum of x: in the other trace order the 8B w4 decode step measured
            # 7% slower (H200, 2026-11-24, tp_decode --quant w4: 2.89-2.91 vs 2.68-2.74 ms a step; Triton
            # schedules the tile's work in trace order).
            prod_CB = products(xe_C, xo_C)
            xsum = jnp.sum(xe_C.astype(jnp.float32) + xo_C.astype(jnp.float32))
            out.append(acc_B + jnp.sum(prod_CB, axis=0) * scale_B + xsum * offset_B)
        return tuple(out)

    def load_tile(i):
        c0 = (split * iters_per_split + i) * unroll
        return [load_chunk(c0 + u) for u in range(unroll)]  # every load issued before any use

    def add_tile(acc_T, tiles):
        for tile in tiles:
            acc_T = add_chunk(acc_T, tile)
        return acc_T

    acc_T = tuple(jnp.zeros((block_o,), jnp.float32) for _ in range(T))
    if prefetch:
        def body(i, carry):
            acc_T, tiles = carry
            next_tiles = load_tile(i + 1)  # in flight while this tile's arithmetic runs
            return add_tile(acc_T, tiles), next_tiles

        acc_T, last = jax.lax.fori_loop(0, iters_per_split - 1, body, (acc_T, load_tile(0)))
        acc_T = add_tile(acc_T, last)
    else:
        acc_T = jax.lax.fori_loop(0, iters_per_split, lambda i, acc_T: add_tile(acc_T, load_tile(i)), acc_T)
    # Masked-off stores get an out-of-bounds index: interpret mode drops their scatter instead of
    # racing a real element with it (as in ragged_paged_attention_kernel.py); the GPU only sees the mask.
    o_B = jnp.where(col_ok_B, o_B, O) if mask_cols else o_B
    for t, acc_B in enumerate(acc_T):
        if mask_cols:
            _masked_store(out_XTO_ref.at[split, t, o_B], acc_B.astype(out_XTO_ref.dtype), col_ok_B)
        else:
            out_XTO_ref[split, t, o_B] = acc_B.astype(out_XTO_ref.dtype)


def _gemv_impl(x_TI, packed_JO, scale_gO, offset_gO, *, group_size, interpret, config):
    T, _ = x_TI.shape
    J, O = packed_JO.shape
    cfg = _choose_gemv_config(J, O, group_size // 2, on_gpu=not interpret and _on_gpu(),
                              x_bf16=x_TI.dtype == jnp.bfloat16, **(config or {}))
    if cfg["unpack"] == "bf16x2":
        require(x_TI.dtype == jnp.bfloat16, f"config['unpack']='bf16x2' needs bfloat16 x, got {x_TI.dtype}")
    kernel = functools.partial(
        _gemv_kernel, T=T, chunk=cfg["chunk"], unroll=cfg["unroll"],
        chunks_per_group=group_size // 2 // cfg["chunk"], iters_per_split=cfg["iters_per_split"],
        block_o=cfg["block_o"],
        # rows past J exist only for a short last tile or a split tail: mask (and clamp) only then
        mask_rows=J % cfg["rows"] != 0 or cfg["iters"] % cfg["iters_per_split"] != 0,
        mask_cols=O % cfg["block_o"] != 0, unpack=cfg["unpack"], prefetch=cfg["prefetch"], interpret=interpret)
    splits = cfg["num_splits"]
    out_XTO = pl.pallas_call(
        kernel,
        # one split stores x's dtype directly: no XLA op after the kernel
        out_shape=jax.ShapeDtypeStruct((splits, T, O), x_TI.dtype if splits == 1 else jnp.float32),
        grid=(cfg["o_blocks"], splits),
        compiler_params=_triton_compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="w4_gemv",
    )(x_TI, packed_JO, scale_gO, offset_gO)
    return out_XTO[0] if splits == 1 else out_XTO.sum(0).astype(x_TI.dtype)
