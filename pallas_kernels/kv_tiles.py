"""How the Triton attention kernel reads K and V: one tile of keys from a float cache or from a quantized
one (`QuantKV`, LMDeploy's quant_policy 8 / 4; layout in pallas_kernels/quant_kv.py).

A quantized tile is dequantized only in part: with x = (code - zero) * scale per key (one scale and
zero point per token and KV head), the tile's dot operands are the integers code - zero (exact in
float16 and float32) and the scale multiplies per key outside the dots:

  scores  q . k_c       = scale_c * (q . (code_c - zero_c))
  output  sum_c p_c v_c = sum_c (p_c scale_c) (code_c - zero_c)

int4 packs channel 2i in a byte's low nibble and 2i + 1 in its high one: the kernel splits the head into
its even and odd channels (two "parts"), one dot each on [C, H / 2] tiles, and q and the output are read
and written at those channels.

No int-to-float conversion either (I2F runs at a quarter of the integer rate on Hopper: the first
version converted and measured 31-36% of the copy bandwidth, slower than a bf16 cache): for bf16 / f16
queries a code c is OR-ed into the mantissa of float16 1024.0, which reads as 1024 + c (exact: f16
steps by 1 on [1024, 2048)), and one float16 subtraction of 1024 + zero leaves code - zero. The dots
run in float16 (q is cast once; int8 codes do not fit bf16's 8-bit significand at that exponent).
A zero point applied after the dots instead (q . code - zero * sum(q)) measured no faster and cancels
~1024-sized terms: 4-7e-3 relative error on int4 at long context from the tensor cores' accumulation,
where this form stays at the bf16 output's rounding. float32 queries convert in float32 (tests; not a
fast path).

Shape letters as in ragged_paged_attention.py; W a part's width (H, or H / 2 for int4), Z cache slots.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._pallas_util import _masked_load, plus_magic
from pallas_kernels.quant_kv import QuantKV


def kv_bits(cache) -> int | None:
    """8 or 4 for a quantized cache, None for a float array."""
    return cache.bits if isinstance(cache, QuantKV) else None


def kv_operands(cache) -> list:
    """The kernel's operands for one cache, slots flattened: [Z, K, H] floats, or codes [Z, K, W] with
    scale and zero point [Z, K]."""
    if not isinstance(cache, QuantKV):
        P, S, K, H = cache.shape
        return [cache.reshape(P * S, K, H)]
    P, S, K, W = cache.data_PSKW.shape
    return [cache.data_PSKW.reshape(P * S, K, W), cache.scale_PSK.reshape(P * S, K),
            cache.zero_PSK.reshape(P * S, K)]


def kernel_reads(cache, head_dim: int) -> bool:
    """Whether the Triton kernel serves this cache and head size: its tiles need a power-of-two head_dim in
    [16, 256] (head_dim 80 / 96 / 100 models, e.g. h2o-danube2 and open_llama_3b, take the tiled version);
    int4 dots run on half heads, and a Triton dot needs a contraction of >= 16, so int4 needs head_dim >= 32."""
    power_of_two = head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256
    return power_of_two and (kv_bits(cache) != 4 or head_dim >= 32)


def num_kv_refs(bits: int | None) -> int:
    return 1 if bits is None else 3


def channel_parts(head_dim: int, bits: int | None) -> list:
    """The head's channels [1, W] that each part's dot covers: all of them, or int4's even and odd."""
    if bits != 4:
        return [jnp.arange(head_dim, dtype=jnp.int32)[None, :]]
    w_1W = jnp.arange(head_dim // 2, dtype=jnp.int32)[None, :]
    return [2 * w_1W, 2 * w_1W + 1]


def dot_dtype(q_dtype, bits: int | None):
    """The dtype of the dots' operands: the cache's for float caches, float16 for quantized ones
    (float32 for float32 queries)."""
    if bits is None or q_dtype == jnp.float32:
        return q_dtype
    return jnp.float16


def _centered(codes_CW, zero_C, dtype):
    """code - zero in `dtype` (exact), codes uint16 [C, W], zero [C] uint8."""
    if dtype != jnp.float16:
        return codes_CW.astype(jnp.float32).astype(dtype) - zero_C.astype(dtype)[:, None]
    shifted_CW, magic = plus_magic(codes_CW, jnp.float16)  # 1024 + code
    return shifted_CW - (zero_C.astype(jnp.float16) + magic)[:, None]


def load_kv_tile(refs, slot_C, kv_head, valid_C, *, bits, head_dim, dtype):
    """One tile of keys: (parts [C, W] in `dtype`, scale_C float32 or None for a float cache); a
    quantized tile's parts hold code - zero. valid_C None: every key is real (no predication); else
    masked-off keys are not read."""
    def load(ref, idx, mask):
        return ref[idx] if valid_C is None else _masked_load(ref.at[idx], mask, 0)

    mask_C1 = None if valid_C is None else valid_C[:, None]
    if bits is None:
        (ref,) = refs
        return [load(ref, (slot_C[:, None], kv_head, channel_parts(head_dim, None)[0]), mask_C1)], None
    data_ref, scale_ref, zero_ref = refs
    width = head_dim * bits // 8
    codes_CW = load(data_ref, (slot_C[:, None], kv_head, jnp.arange(width, dtype=jnp.int32)[None, :]), mask_C1)
    scale_C = load(scale_ref, (slot_C, kv_head), valid_C).astype(jnp.float32)
    zero_C = load(zero_ref, (slot_C, kv_head), valid_C)
    codes_CW = codes_CW.astype(jnp.uint16)
    parts = [codes_CW] if bits == 8 else [codes_CW & 0xF, codes_CW >> 4]
    return [_centered(p, zero_C, dtype) for p in parts], scale_C
