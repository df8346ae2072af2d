"""How the Triton attention kernel reads K and V: one tile of keys from a float cache or from a quantized
one (`QuantKV`, LMDeploy's quant_policy 8 / 4; layout in pallas_kernels/quant_kv.py).

A quantized tile is never dequantized element by element. With x = (code - zero) * scale per key (one
scale and zero point per token and KV head), the products factor:

  scores  q . k_c   = scale_c * (q . code_c - zero_c * sum(q))
  output  sum_c p_c v_c = sum_c (p_c scale_c) code_c - sum_c (p_c scale_c) zero_c

so the dots run on the raw codes (exact in bf16: integers up to 255) and the scale and zero point cost a
few operations per key, not per element. int4 packs channel 2i in a byte's low nibble and 2i + 1 in its
high one: the kernel splits the head into its even and odd channels (two "parts"), one dot each on
[C, H / 2] nibble tiles, and q and the output are read and written at those channels.

Shape letters as in ragged_paged_attention.py; W a part's width (H, or H / 2 for int4), Z cache slots.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._pallas_util import _masked_load
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


def num_kv_refs(bits: int | None) -> int:
    return 1 if bits is None else 3


def channel_parts(head_dim: int, bits: int | None) -> list:
    """The head's channels [1, W] that each part's dot covers: all of them, or int4's even and odd."""
    if bits != 4:
        return [jnp.arange(head_dim, dtype=jnp.int32)[None, :]]
    w_1W = jnp.arange(head_dim // 2, dtype=jnp.int32)[None, :]
    return [2 * w_1W, 2 * w_1W + 1]


def load_kv_tile(refs, slot_C, kv_head, valid_C, *, bits, head_dim, dtype):
    """One tile of keys: (parts [C, W] in `dtype`, scale_C, zero_C (float32; None for a float cache)).
    valid_C None: every key is real (no predication); else masked-off keys are not read."""
    def load(ref, idx, mask):
        return ref[idx] if valid_C is None else _masked_load(ref.at[idx], mask, 0)

    mask_C1 = None if valid_C is None else valid_C[:, None]
    if bits is None:
        (ref,) = refs
        return [load(ref, (slot_C[:, None], kv_head, channel_parts(head_dim, None)[0]), mask_C1)], None, None
    data_ref, scale_ref, zero_ref = refs
    width = head_dim * bits // 8
    codes_CW = load(data_ref, (slot_C[:, None], kv_head, jnp.arange(width, dtype=jnp.int32)[None, :]), mask_C1)
    scale_C = load(scale_ref, (slot_C, kv_head), valid_C).astype(jnp.float32)
    zero_C = load(zero_ref, (slot_C, kv_head), valid_C).astype(jnp.float32)
    parts = [codes_CW] if bits == 8 else [codes_CW & 0xF, codes_CW >> 4]
    return [p.astype(jnp.float32).astype(dtype) for p in parts], scale_C, zero_C
