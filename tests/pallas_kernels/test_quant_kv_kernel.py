"""The Triton attention kernel over a quantized KV cache (quant_policy 8 / 4) vs the jnp reference over
the same cache (which dequantizes the blocks it reads), on ragged batches whose unowned slots carry a
NaN scale: a kernel that reads one returns NaN.

On CPU the kernel runs in Pallas interpret mode; on a GPU compiled.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax.layers.kv_quant import quantize_cache
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.quant_kv import QuantKV
from rpa_cases import make_case, rel_err

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 5e-4 if ON_GPU else 1e-5, "bfloat16": 1e-2}

# name: (q_lens, kv_lens, N, K, H, S, dtype, pad_tokens)
CASES = {
    "decode_g4_h64_s16": ([1] * 4, [1, 17, 64, 100], 8, 2, 64, 16, "float32", 0),
    "decode_g8_h128_s64_bf16_padded": ([1] * 3, [1, 64, 129], 8, 1, 128, 64, "bfloat16", 2),
    "mixed_g4_h64_s16_bf16": ([1, 9, 30], [33, 9, 70], 8, 2, 64, 16, "bfloat16", 3),
    "prefill_g2_h32_s32": ([37, 20], [37, 50], 4, 2, 32, 32, "float32", 0),
}


def poisoned_quant_cache(cache_PSKH, bits, dtype) -> QuantKV:
    """The whole cache quantized per token and head; a NaN slot (unowned) gets a NaN scale."""
    owned_PSK = np.isfinite(cache_PSKH).all(axis=-1)
    cache = quantize_cache(jnp.asarray(np.nan_to_num(cache_PSKH), jnp.float32), bits, dtype)
    return QuantKV(cache.data_PSKW, jnp.where(owned_PSK, cache.scale_PSK, jnp.nan), cache.zero_PSK, bits,
                   cache.compute_dtype)


def _quant_case(name, bits, seed=0, v_gain=1.0):
    q_lens, kv_lens, n, k, h, s, dtype, pad_t = CASES[name]
    case = make_case(np.random.default_rng(seed), q_lens, kv_lens, num_q_heads=n, num_kv_heads=k,
                     head_dim=h, block_size=s, pad_tokens=pad_t)
    case.v_cache_PSKH = case.v_cache_PSKH * v_gain
    kc, vc = (poisoned_quant_cache(c, bits, dtype) for c in (case.k_cache_PSKH, case.v_cache_PSKH))
    assert bool(jnp.isnan(kc.scale_PSK).any())  # the poison survived quantization
    rest = [jnp.asarray(a) for a in (case.kv_lens_B, case.block_tables_BM, case.cu_q_lens_B1)]
    return case, (jnp.asarray(case.q_TNH, dtype), kc, vc, *rest), dict(sm_scale=1.0 / np.sqrt(h)), dtype


def _reference_f32(args, **kw):
    q, kc, vc, *rest = args
    kc32, vc32 = (QuantKV(c.data_PSKW, c.scale_PSK, c.zero_PSK, c.bits, "float32") for c in (kc, vc))
    return np.asarray(rpa.ragged_paged_attention_reference(q.astype(jnp.float32), kc32, vc32, *rest, **kw))


def _check(out, args, case, dtype, **kw):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN in output: an unowned slot was read"
    assert (out[int(case.cu_q_lens_B1[-1]):] == 0).all(), "padding rows must be zero"
    err = rel_err(out, _reference_f32(args, **kw))
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_reads_the_quantized_cache(name, bits):
    case, args, kw, dtype = _quant_case(name, bits)
    out = jax.jit(functools.partial(rpa.ragged_paged_attention, impl="kernel", interpret=INTERPRET, **kw))(*args)
    assert out.dtype == jnp.dtype(dtype) and out.shape == case.q_TNH.shape
    _check(out, args, case, dtype, **kw)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_keeps_tiny_values_scales(bits):
    """V of magnitude 1e-4 (scales ~1e-6): the float16 dot weights p * scale would underflow unless
    normalized by the tile's largest scale."""
    case, args, kw, dtype = _quant_case("decode_g8_h128_s64_bf16_padded", bits, v_gain=1e-4)
    out = jax.jit(functools.partial(rpa.ragged_paged_attention, impl="kernel", interpret=INTERPRET, **kw))(*args)
    _check(out, args, case, dtype, **kw)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_split_kv_over_the_quantized_cache(bits):
    """The flash-decoding path with quantized tiles, small kv tiles so the unmasked loop runs too."""
    case, args, kw, dtype = _quant_case("mixed_g4_h64_s16_bf16", bits, seed=1)
    out = rpa.ragged_paged_attention_kernel(*args, interpret=INTERPRET, config=dict(num_splits=3, block_n=16), **kw)
    _check(out, args, case, dtype, **kw)


def test_quantized_reference_is_the_float_reference_on_the_dequantized_cache():
    """What the kernel is checked against: the reference over a QuantKV equals the reference over the
    float cache its codes stand for (masked NaN slots zeroed: the reference never reads them either)."""
    _, args, kw, _ = _quant_case("decode_g4_h64_s16", 8)
    q, kc, vc, *rest = args
    floats = [jnp.nan_to_num(c[jnp.arange(c.shape[0])]) for c in (kc, vc)]
    np.testing.assert_allclose(rpa.ragged_paged_attention_reference(q, *floats, *rest, **kw),
                               _reference_f32(args, **kw), rtol=1e-6, atol=1e-6)


def test_kernel_rejects_an_int4_cache_with_a_narrow_head():
    """int4 dots run on half heads; Triton's dot needs 16, and the error names the head dim."""
    _, args, kw, _ = _quant_case("prefill_g2_h32_s32", 4)
    q, kc, vc, *rest = args
    narrow = [QuantKV(c.data_PSKW[..., :8], c.scale_PSK, c.zero_PSK, 4, c.compute_dtype) for c in (kc, vc)]
    with pytest.raises(ValueError, match="head_dim=16 must be >= 32"):
        rpa.ragged_paged_attention_kernel(q[..., :16], *narrow, *rest, interpret=True, **kw)


def test_auto_takes_the_tiled_op_for_an_int4_cache_with_a_narrow_head():
    """What the kernel cannot read, "auto" sends to the tiled op instead of raising."""
    _, args, kw, _ = _quant_case("prefill_g2_h32_s32", 4)
    q, kc, vc, *rest = args
    narrow = [QuantKV(c.data_PSKW[..., :8], c.scale_PSK, c.zero_PSK, 4, c.compute_dtype) for c in (kc, vc)]
    auto = rpa.ragged_paged_attention(q[..., :16], *narrow, *rest, impl="auto", interpret=True, **kw)
    tiled = rpa.ragged_paged_attention(q[..., :16], *narrow, *rest, impl="tiled", **kw)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(tiled))


def test_the_mosaic_prefill_kernel_takes_float_caches_only():
    from pallas_kernels.ragged_paged_prefill_tiles import mgpu_supported

    q = jnp.zeros((512, 8, 64), jnp.bfloat16)
    cache = jnp.zeros((4, 64, 2, 64), jnp.bfloat16)
    assert mgpu_supported(q, cache, None)
    assert not mgpu_supported(q, quantize_cache(cache, 8), None)
