"""KV-cache quantization, LMDeploy's `quant_policy`: 8 = int8, 4 = int4, asymmetric, one scale and zero
point per token per KV head (layout in pallas_kernels/quant_kv.py): x ~ (code - zero) * scale, scale
float16, the zero point an integer code in uint8 (3 bytes of parameters per token per head: the int8
cache then holds 1.91x the tokens of bf16 at head_dim 64 and 1.94x at 128; a float16 zero would make
that 1.88x at 64). Quantize on write; attention reads the codes (the GPU kernel:
pallas_kernels/kv_tiles.py) or dequantizes the blocks it reads (the XLA tiled op, the reference).

int4 needs more than rounding (SmolLM2-135M, head_dim 64, tests/convert/data/perplexity.txt, float32
KV 10.641): int4 K alone costs +39% of perplexity, V alone +2%. A few channels of K carry most of its
magnitude and one scale per token spends its 16 levels on them. So an int4 cache stores, per layer
and KV head:

  K as k @ k_map, read by queries q @ q_map (k_map q_map^T = I, so q . k is unchanged). Without
  calibration k_map = q_map = R, an orthonormal [H, H] (Hadamard: QuaRot's trick, spreading every
  channel over all of them). With it (`lmjax.models.kv_calibration`, run when an engine starts)
  k_map = B R and q_map = B^-T R, B chosen from the second moments of RoPE'd K and q so that the
  score error of a per-token quantizer is least (lmjax.layers.kv_basis).
  K's range clipped per token and head to the ratio of least squared error (`K_CLIP_RATIOS`).
  V as v @ R, the attention output rotated back (R^T per head): outliers spread the same way.

Measured (same text; engine path, prompt_logits with the cache): +48% plain, +17.6% with K @ R; with
the calibrated maps, the clip and V rotated: see tests/convert/test_kv_quant.py and BENCHMARKS.md.
int8 needs none of it (+0.3%) and gets none. The float16 zero point of an earlier version cost int8
+0.34%: at 8 bits a float16 zero carries an error of about 1/16 of a step.

Shape letters as in lmjax.layers.attention (T tokens, N q heads, K kv heads, H head dim, P blocks,
S block size).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lmjax import parallel
from pallas_kernels.quant_kv import SCALE_DTYPE, ZERO_DTYPE, QuantKV, dequantize_kv  # noqa: F401 (re-exported)

KV_POLICIES = (8, 4)
KV_SCALE_DTYPE = SCALE_DTYPE
# int4 K: per token and head, the range [min, max] * ratio of least squared error (1: no clip).
K_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_policy(bits: int) -> None:
    if bits not in KV_POLICIES:
        raise ValueError(f"quant_policy={bits} is not supported; choose one of {KV_POLICIES} (0: no quantization)")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, quant_policy: int = 0,
                       dtype=jnp.bfloat16) -> int:
    """Cache bytes one token takes (K and V, every layer)."""
    if quant_policy == 0:
        per_head = head_dim * jnp.dtype(dtype).itemsize
    else:
        _check_policy(quant_policy)
        per_head = head_dim * quant_policy // 8 + jnp.dtype(KV_SCALE_DTYPE).itemsize + jnp.dtype(ZERO_DTYPE).itemsize
    return 2 * num_layers * num_kv_heads * per_head


@functools.lru_cache(maxsize=None)
def kv_rotation(head_dim: int) -> np.ndarray:
    """Orthonormal [H, H]: Sylvester's Hadamard / sqrt(H) for a power of two, else a fixed random
    orthogonal matrix (seeded: the same for every process and every run)."""
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(head_dim)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def rotate_heads(x_XH: jax.Array, transpose: bool = False) -> jax.Array:
    """x @ R (or x @ R^T) over the last (head) dim, in float32."""
    r = jnp.asarray(kv_rotation(x_XH.shape[-1]))
    return jnp.matmul(x_XH.astype(jnp.float32), r.T if transpose else r, precision=_HIGHEST)


def map_heads(x_TXH: jax.Array, map_KHH: jax.Array) -> jax.Array:
    """Each head of x times its KV head's map, in float32: X = K heads (keys) or a multiple of K (queries,
    grouped as the attention op groups them: head n belongs to KV head n // (X / K))."""
    T, X, H = x_TXH.shape
    K = map_KHH.shape[0]
    x_TKGH = x_TXH.astype(jnp.float32).reshape(T, K, X // K, H)
    return jnp.einsum("tkgh,khj->tkgj", x_TKGH, map_KHH, precision=_HIGHEST).reshape(T, X, H)


def quantize_kv(x_TKH: jax.Array, bits: int, clip_ratios=(1.0,)) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(data uint8 [T, K, W], scale [T, K], zero [T, K]): x ~ (code - zero) * scale per token and head.

    The range is [min, max] (times the clip ratio, of those given, whose codes have the least squared
    error; the first of equals) widened to hold 0, so the integer zero point is a code in
    [0, 2^bits - 1]; scale and zero are computed from the stored (float16-rounded) scale, so rounding
    stays within half a step. The ratios are one leading axis R, so XLA fuses the search into a few
    launches instead of a chain per ratio."""
    _check_policy(bits)
    levels = 2**bits - 1
    x = x_TKH.astype(jnp.float32)
    ratio_R11 = jnp.asarray(clip_ratios, jnp.float32)[:, None, None]
    lo_RTK = jnp.minimum(jnp.min(x, axis=-1) * ratio_R11, 0.0)
    hi_RTK = jnp.maximum(jnp.max(x, axis=-1) * ratio_R11, 0.0)
    scale_RTK = ((hi_RTK - lo_RTK) / levels).astype(KV_SCALE_DTYPE)
    scale_RTK = jnp.where(scale_RTK == 0, jnp.ones_like(scale_RTK), scale_RTK)
    step_RTK = scale_RTK.astype(jnp.float32)
    zero_RTK = jnp.clip(jnp.round(-lo_RTK / step_RTK), 0, levels)
    q_RTKH = jnp.clip(jnp.round(x / step_RTK[..., None]) + zero_RTK[..., None], 0, levels)
    if len(clip_ratios) == 1:
        q, scale, zero = q_RTKH[0], scale_RTK[0], zero_RTK[0]
    else:
        err_RTK = jnp.sum(((q_RTKH - zero_RTK[..., None]) * step_RTK[..., None] - x) ** 2, axis=-1)
        best_1TK = jnp.argmin(err_RTK, axis=0)[None]
        scale, zero = (jnp.take_along_axis(a, best_1TK, axis=0)[0] for a in (scale_RTK, zero_RTK))
        q = jnp.take_along_axis(q_RTKH, best_1TK[..., None], axis=0)[0]
    q = q.astype(jnp.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale, zero.astype(ZERO_DTYPE)


def quantize_cache(cache_PSKH: jax.Array, bits: int, dtype=None) -> QuantKV:
    """A whole float cache [P, S, K, H] quantized per token and head (benchmarks and tests; the engine
    quantizes on write), standing in for `dtype` (default: the cache's)."""
    P, S, K, H = cache_PSKH.shape
    data, scale, zero = quantize_kv(cache_PSKH.reshape(P * S, K, H), bits)
    return QuantKV(data.reshape(P, S, K, -1), scale.reshape(P, S, K), zero.reshape(P, S, K), bits,
                   jnp.dtype(dtype or cache_PSKH.dtype).name)


def default_kv_maps(num_kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(k_map, q_map) [K, H, H] without calibration: the rotation R for both."""
    r_KHH = np.broadcast_to(kv_rotation(head_dim), (num_kv_heads, head_dim, head_dim))
    return r_KHH, r_KHH


def make_quant_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                         quant_policy: int, dtype=jnp.float32, mesh=None,
                         kv_maps: list[tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[QuantKV, QuantKV]]:
    """Zeroed per-layer (k, v) quantized caches standing in for float caches of `dtype`; under a mesh
    with a tp axis, sharded on KV heads (repeated as in `lmjax.parallel.kv_cache_heads`). int4 K caches
    carry each layer's (k_map, q_map) [num_kv_heads, H, H] from `kv_maps` (lmjax.models.kv_calibration),
    else the rotation alone (`default_kv_maps`)."""
    _check_policy(quant_policy)
    if quant_policy == 4 and head_dim % 2:
        raise ValueError(f"quant_policy=4 packs two values per byte: head_dim={head_dim} must be even")
    if kv_maps is not None and len(kv_maps) != num_layers:
        raise ValueError(f"kv_maps has {len(kv_maps)} layers' maps, the model {num_layers} layers")
    tp = parallel.tp_size(mesh) if mesh is not None else 1
    K = parallel.kv_cache_heads(num_kv_heads, tp) if tp > 1 else num_kv_heads
    P, S, W = num_blocks, block_size, head_dim * quant_policy // 8

    def one(k_map_KHH=None, q_map_KHH=None):
        return QuantKV(jnp.zeros((P, S, K, W), jnp.uint8), jnp.ones((P, S, K), KV_SCALE_DTYPE),
                       jnp.zeros((P, S, K), ZERO_DTYPE), quant_policy, jnp.dtype(dtype).name, k_map_KHH, q_map_KHH)

    def builder(*maps):  # zeros made where they live (no whole-cache copy on one device), maps placed likewise
        if tp == 1:
            return one
        spec = quant_kv_spec(jax.eval_shape(one, *maps))
        return jax.jit(one, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), spec))

    plain = builder()
    if quant_policy != 4:
        return [(plain(), plain()) for _ in range(num_layers)]
    maps = [tuple(jnp.repeat(jnp.asarray(m, jnp.float32), K // num_kv_heads, axis=0) for m in layer_maps)
            for layer_maps in (kv_maps or [default_kv_maps(num_kv_heads, head_dim)] * num_layers)]
    mapped = builder(*maps[0])
    return [(mapped(*layer_maps), plain()) for layer_maps in maps]


def quant_kv_spec(make_or_cache) -> QuantKV:
    """PartitionSpecs of a QuantKV sharded on its KV-head axis (a QuantKV of specs: shard_map's
    in_specs and jit's out_shardings take it as a tree prefix)."""
    cache = jax.eval_shape(make_or_cache) if callable(make_or_cache) else make_or_cache
    heads = parallel.TP_AXIS
    maps = PartitionSpec(heads, None, None) if cache.k_map_KHH is not None else None
    return QuantKV(PartitionSpec(None, None, heads, None), PartitionSpec(None, None, heads),
                   PartitionSpec(None, None, heads), cache.bits, cache.compute_dtype, maps, maps)


def write_kv_quant(k_cache: QuantKV, v_cache: QuantKV, k_TKH, v_TKH, slot_mapping_T):
    """`lmjax.layers.attention.write_kv` for quantized caches: quantize (int4: K mapped and clipped, V
    rotated), scatter."""
    def write(cache: QuantKV, x_TKH, clip_ratios=(1.0,)):
        P, S, K, W = cache.data_PSKW.shape
        q, scale, zero = quantize_kv(x_TKH, cache.bits, clip_ratios)
        data = cache.data_PSKW.reshape(P * S, K, W).at[slot_mapping_T].set(q).reshape(P, S, K, W)
        scale_ = cache.scale_PSK.reshape(P * S, K).at[slot_mapping_T].set(scale).reshape(P, S, K)
        zero_ = cache.zero_PSK.reshape(P * S, K).at[slot_mapping_T].set(zero).reshape(P, S, K)
        return dataclasses.replace(cache, data_PSKW=data, scale_PSK=scale_, zero_PSK=zero_)

    K = k_cache.data_PSKW.shape[2]
    if K != k_TKH.shape[1]:  # the cache repeats KV heads under tp (see lmjax.parallel.kv_cache_heads)
        k_TKH, v_TKH = (jnp.repeat(x, K // x.shape[1], axis=1) for x in (k_TKH, v_TKH))
    if k_cache.bits != 4:
        return write(k_cache, k_TKH), write(v_cache, v_TKH)
    k_TKH = map_heads(k_TKH, _int4_maps(k_cache)[0])
    return write(k_cache, k_TKH, K_CLIP_RATIOS), write(v_cache, rotate_heads(v_TKH))


def _int4_maps(k_cache: QuantKV) -> tuple[jax.Array, jax.Array]:
    if k_cache.k_map_KHH is None or k_cache.q_map_KHH is None:
        raise ValueError("an int4 K cache needs its k_map / q_map (make_quant_kv_caches sets them); "
                         "this QuantKV has none")
    return k_cache.k_map_KHH, k_cache.q_map_KHH


def paged_attention_quant(q_TNH, k_cache: QuantKV, v_cache: QuantKV, kv_lens_B, block_tables_BM, cu_q_lens_B1, *,
                          sm_scale: float, sliding_window: int | None = None, impl: str = "auto"):
    """Attention over quantized caches, whose every impl reads the codes (the Pallas kernel on GPU; see
    pallas_kernels.ragged_paged_attention). int4: the queries mapped like the stored K, and the output
    rotated back from V's rotation."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    if k_cache.bits != 4:
        return ragged_paged_attention(q_TNH, k_cache, v_cache, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                                      sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
    q_in_TNH = map_heads(q_TNH, _int4_maps(k_cache)[1]).astype(q_TNH.dtype)
    out_TNH = ragged_paged_attention(q_in_TNH, k_cache, v_cache, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                                     sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
    return rotate_heads(out_TNH, transpose=True).astype(out_TNH.dtype)
