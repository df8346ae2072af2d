"""KV-cache quantization (LMDeploy's quant_policy 8 / 4) in the jnp reference path: rounding bounds,
attention over a quantized cache, capacity in the same memory, and SmolLM2 perplexity.

The model reaches the quantized cache here through test-only substitution of `write_kv` /
`paged_attention` in `lmjax.models.llama` (the engine hook is not wired yet: see lmjax/layers/quant.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lmjax.models.forward as forward
import lmjax.models.llama as llama
from lmjax.layers import attention
from lmjax.layers.attention import contiguous_metadata
from lmjax.layers.quant import (QuantKV, dequantize_kv, kv_bytes_per_token, make_quant_kv_caches,
                                paged_attention_quant, quantize_kv, write_kv_quant)
from test_quant import perplexity  # noqa: F401  (same fixtures and measure as the weight tests)
from test_quant import base_ppl, text_ids  # noqa: F401


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_rounding_is_at_most_half_a_step(bits):
    x = 3 * jax.random.normal(jax.random.key(0), (7, 4, 64))
    q, scale, zero = quantize_kv(x, bits)
    assert q.dtype == jnp.uint8 and q.shape == (7, 4, 64 * bits // 8) and scale.shape == zero.shape == (7, 4)
    err = jnp.abs(dequantize_kv(q, scale, zero, bits, jnp.float32) - x)
    assert jnp.all(err <= scale.astype(jnp.float32)[..., None] * 0.5 + 2e-3 * jnp.abs(x).max())


@pytest.mark.parametrize("bits, tol", [(8, 0.02), (4, 0.25)])
def test_reference_attention_reads_the_quantized_cache(bits, tol):
    rng = np.random.default_rng(0)
    lengths, S, K, N, H = [5, 19, 1], 8, 2, 4, 32
    num_blocks = 1 + sum(-(-n // S) for n in lengths)
    meta = contiguous_metadata(lengths, S, num_blocks)
    T = sum(lengths)
    q, k, v = (jnp.asarray(rng.standard_normal((T, n, H)), jnp.float32) for n in (N, K, K))
    dense = (jnp.zeros((num_blocks, S, K, H)), jnp.zeros((num_blocks, S, K, H)))
    want = attention.paged_attention(q, *attention.write_kv(*dense, k, v, meta.slot_mapping_T), meta,
                                     sm_scale=H**-0.5, impl="reference")
    (kc, vc), = make_quant_kv_caches(1, num_blocks, S, K, H, bits)
    kc, vc = write_kv_quant(kc, vc, k, v, meta.slot_mapping_T)
    got = jax.jit(lambda q, kc, vc: paged_attention_quant(q, kc, vc, meta, sm_scale=H**-0.5))(q, kc, vc)
    assert float(jnp.max(jnp.abs(got - want))) < tol


@pytest.mark.parametrize("shape, min8, min4", [
    ((32, 8, 128), 1.9, 3.5),   # Llama-3-8B: 1.94x and 3.76x
    ((30, 3, 64), 1.85, 3.5),   # SmolLM2-135M, head_dim 64: the float16 scale/zero weigh more (1.88x, 3.56x)
])
def test_quantized_cache_holds_more_tokens_in_the_same_memory(shape, min8, min4):
    layers, K, H = shape
    bf16 = kv_bytes_per_token(layers, K, H, 0, jnp.bfloat16)
    blocks, S = 4, 16
    for bits, minimum in ((8, min8), (4, min4)):
        caches = make_quant_kv_caches(layers, blocks, S, K, H, bits)
        allocated = sum(c.nbytes for pair in caches for c in pair)
        assert allocated == kv_bytes_per_token(layers, K, H, bits) * blocks * S  # the formula is the truth
        assert bf16 / kv_bytes_per_token(layers, K, H, bits) >= minimum


@pytest.fixture()
def quantized_kv_model(monkeypatch):
    """prompt_logits with a quantized cache: returns a setter for the policy."""
    def use(bits: int):
        def make(cfg, num_blocks, block_size, dtype, mesh=None):
            return make_quant_kv_caches(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, bits)

        def write(k_cache, v_cache, k, v, slots):
            return write_kv_quant(k_cache, v_cache, k, v, slots)

        def attend(q, k_cache, v_cache, meta, *, sm_scale, sliding_window=None):
            assert isinstance(k_cache, QuantKV)
            return paged_attention_quant(q, k_cache, v_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window)

        monkeypatch.setattr(forward, "make_kv_caches", make)
        monkeypatch.setattr(llama, "write_kv", write)
        monkeypatch.setattr(llama, "paged_attention", attend)
    return use


# int4 KV (per-token K scales) misses its 5% target on SmolLM2 (15.75 vs 10.64, measured 2026-11-22): not
# tested as passing until K gets per-channel scales; recorded in the issue note, not hidden behind an xfail.
@pytest.mark.parametrize("bits, tolerance", [(8, 0.01)])
def test_smollm2_perplexity_with_quantized_kv(smollm2_lmjax, text_ids, base_ppl, quantized_kv_model,  # noqa: F811
                                              bits, tolerance):
    from flax import nnx

    quantized_kv_model(bits)
    ppl = perplexity(nnx.clone(smollm2_lmjax.model), text_ids)  # a clone: a fresh jit trace
    print(f"SmolLM2 perplexity: float32 KV {base_ppl:.4f}, KV int{bits} {ppl:.4f}")
    assert ppl <= base_ppl * (1 + tolerance)
