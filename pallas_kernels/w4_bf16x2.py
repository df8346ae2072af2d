"""The w4 gemv's "bf16x2" unpack: nibbles to bf16 and their products with x in packed PTX.

Why: the float32 gemv path is bound by its instructions, not by HBM (H200, 2026-11-24: ~6 per nibble
- shift, mask, exponent-trick or, subtract, FMA, sum - cap it at ~1.5 TB/s of 4.3; reading the bytes
as 32-bit words or prefetching the next tile changed nothing). Here one inline-PTX instance takes 4
packed bytes (4 output columns, rows 2j / 2j + 1 in their low / high nibbles) and does two at a time:

  prmt    bytes 0,1 (2,3) into the two 16-bit lanes of a register
  lop3    (t & 0x000F000F) | 0x43004300: the low nibbles q as the bf16 pair 128 + q (exact)
  shr+lop3 the same for the high nibbles
  fma     (128 + q) * 1 - 136 = q - 8, exact (centered: |q - 8| <= 8 keeps the products' rounding
          small next to y, since sum(x) * 8 * scale, exact in float32, is added back by the caller)
  mul/fma xe * (lo - 8) + xo * (hi - 8) in bf16x2
  shl/and the two bf16 sums to float32 (bf16 is float32's top half)

= 20 instructions for 8 nibbles. The products and their pair sum round to bf16 (8 bits): relative to
the float32 dense product the output is off by 2.6e-3 (float32 products: 1.7e-3, the bf16 output's
rounding; H200, 8B shapes, 2026-11-24), the same order as a matmul over weights dequantized to bf16.
The caller sums rows in float32. Measured there: one 8B decoder layer 56 us vs 90 us for the float32
path (2.6 TB/s of packed bytes at best).

`interpret=True` (CPU tests) runs a jnp emulation with the same roundings instead of the PTX.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CENTER = 8  # the codes enter the products as q - CENTER

# $0..$3: float32 out (columns 0..3); $4: the 4 packed bytes; $5, $6: xe as bf16 pairs (columns 0,1 and
# 2,3; the same value twice: x is per row); $7, $8: xo likewise.
_PTX = """
{
.reg .b32 t01, t23, l01, l23, h01, h23, s01, s23, zero, one, m136, mask, magic;
mov.b32 zero, 0;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
mov.b32 mask, 0x000F000F;
mov.b32 magic, 0x43004300;
prmt.b32 t01, $4, zero, 0x4140;
prmt.b32 t23, $4, zero, 0x4342;
lop3.b32 l01, t01, mask, magic, 0xEA;
lop3.b32 l23, t23, mask, magic, 0xEA;
shr.u32 h01, t01, 4;
shr.u32 h23, t23, 4;
lop3.b32 h01, h01, mask, magic, 0xEA;
lop3.b32 h23, h23, mask, magic, 0xEA;
fma.rn.bf16x2 l01, l01, one, m136;
fma.rn.bf16x2 l23, l23, one, m136;
fma.rn.bf16x2 h01, h01, one, m136;
fma.rn.bf16x2 h23, h23, one, m136;
mul.rn.bf16x2 s01, $5, l01;
mul.rn.bf16x2 s23, $6, l23;
fma.rn.bf16x2 s01, $7, h01, s01;
fma.rn.bf16x2 s23, $8, h23, s23;
shl.b32 $0, s01, 16;
and.b32 $1, s01, 0xFFFF0000;
shl.b32 $2, s23, 16;
and.b32 $3, s23, 0xFFFF0000;
}
"""


def _round_to_bf16(x):
    """float32 rounded to the nearest bf16 (ties to even), kept in float32, by integer ops: XLA may drop
    an astype(bf16).astype(float32) pair (excess precision allowed), which would skip the rounding
    the PTX does. Finite values only (the products of finite x and 4-bit codes)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bf16x2_products(p_CB, xe_C, xo_C, *, interpret: bool):
    """float32 [C, B]: xe * (low - 8) + xo * (high - 8) per packed byte, with bf16 products and sum.
    p_CB uint8; xe_C, xo_C bfloat16 (the rows' even / odd x)."""
    f32 = jnp.float32
    if interpret:
        low_CB = (p_CB & 0xF).astype(f32) - CENTER
        high_CB = (p_CB >> 4).astype(f32) - CENTER
        s_CB = _round_to_bf16(xe_C[:, None].astype(f32) * low_CB)  # exact in float32, then one rounding
        return _round_to_bf16(xo_C[:, None].astype(f32) * high_CB + s_CB)
    from jax.experimental.pallas import triton as plt  # the GPU only: the Triton backend's inline asm

    (out_CB,) = plt.elementwise_inline_asm(
        _PTX, args=[p_CB, jnp.broadcast_to(xe_C[:, None], p_CB.shape), jnp.broadcast_to(xo_C[:, None], p_CB.shape)],
        constraints="=r,=r,=r,=r,r,r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(p_CB.shape, f32)])
    return out_CB
