"""A quantized paged KV cache as the attention ops read it (LMDeploy's quant_policy 8 / 4).

One layer's K (or V) cache: codes uint8 [P, S, K, W] and, per token per KV head, a float16 scale and
an integer zero point (uint8) [P, S, K]: x = (code - zero) * scale. W = H for 8 bits; W = H / 2 for
4 bits (two codes per byte, element 2i in the low nibble). The writer is
`lmjax.layers.kv_quant.write_kv_quant` (which also says why int4 K is stored mapped).

`QuantKV` stands in for the float cache array [P, S, K, H] it replaces: `shape`, `ndim` and `dtype`
are those of that array, and indexing it with block ids returns those blocks dequantized (float32),
so ragged_paged_attention_tiled.py runs on it unchanged and dequantizes only the blocks each tile
reads. Shape letters as in ragged_paged_attention.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.float16
ZERO_DTYPE = jnp.uint8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantKV:
    """data uint8 [P, S, K, W], scale float16 and zero uint8 [P, S, K]; bits 8 or 4; dtype: that of
    the float cache it stands for (the queries' dtype). k_map / q_map (float32 [K, H, H], optional): a K
    cache holds k @ k_map per head and is read by queries q @ q_map (k_map q_map^T = I: q . k unchanged);
    lmjax sets them on int4 K caches (lmjax.layers.kv_quant). The kernels never read them: the codes are
    what they dequantize, and q comes to them already mapped."""

    data_PSKW: jax.Array
    scale_PSK: jax.Array
    zero_PSK: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    compute_dtype: str = dataclasses.field(metadata=dict(static=True), default="float32")
    k_map_KHH: jax.Array | None = None
    q_map_KHH: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        P, S, K, W = self.data_PSKW.shape
        return P, S, K, W * 8 // self.bits

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        return self.data_PSKW.nbytes + self.scale_PSK.nbytes + self.zero_PSK.nbytes

    def __getitem__(self, blocks) -> jax.Array:
        """The cache's blocks `blocks` (any index of the leading axis), dequantized to float32."""
        return dequantize_kv(self.data_PSKW[blocks], self.scale_PSK[blocks], self.zero_PSK[blocks], self.bits,
                             jnp.float32)


def unpack_int4(data_XW: jax.Array) -> jax.Array:
    """uint8 [..., W] -> codes [..., 2W]: element 2i from the low nibble, 2i + 1 from the high one."""
    return jnp.stack([data_XW & 0xF, data_XW >> 4], axis=-1).reshape(*data_XW.shape[:-1], 2 * data_XW.shape[-1])


def dequantize_kv(data, scale, zero, bits: int, dtype) -> jax.Array:
    """codes [..., W] with scale / zero point [...] -> values [..., H] in `dtype` (math in float32)."""
    if bits == 4:
        data = unpack_int4(data)
    codes = data.astype(jnp.float32) - zero[..., None].astype(jnp.float32)
    return (codes * scale[..., None].astype(jnp.float32)).astype(dtype)
