"""The int4 KV cache's calibrated K / q maps (lmjax.layers.kv_basis, lmjax.models.kv_calibration), the
int4 write's clip search, and the engine calibrating at start. Its effect on SmolLM2's perplexity:
test_kv_quant.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmjax.layers.kv_basis import balance_matrix, int4_kv_maps
from lmjax.layers.kv_quant import (K_CLIP_RATIOS, QuantKV, dequantize_kv, kv_rotation, make_quant_kv_caches,
                                   map_heads, quantize_kv)


def _anisotropic_kq(T=512, K=2, G=3, H=16, sample_seed=0):
    """Keys with a few loud channels and queries loud elsewhere, correlated across channels (one fixed
    distribution; `sample_seed` draws another sample of it): what a per-token quantizer of K handles worst."""
    dist = np.random.default_rng(100)
    mix = dist.standard_normal((H, H)) / np.sqrt(H) + np.eye(H)
    k_scale, q_scale = np.exp(dist.uniform(-2, 2, H)), np.exp(dist.uniform(-1, 1, H))
    rng = np.random.default_rng(sample_seed)
    k = (rng.standard_normal((T, K, H)) * k_scale) @ mix
    q = (rng.standard_normal((T, K * G, H)) * q_scale) @ mix
    return k.astype(np.float32), q.astype(np.float32)


def test_maps_keep_every_score_exact():
    k, q = _anisotropic_kq()
    k_map, q_map = int4_kv_maps(k, q, kv_rotation(16))
    assert k_map.shape == q_map.shape == (2, 16, 16) and k_map.dtype == np.float32
    for h in range(2):
        np.testing.assert_allclose(k_map[h] @ q_map[h].T, np.eye(16), atol=1e-4)
    scores = jnp.einsum("tkgh,skh->tkgs", q.reshape(512, 2, 3, 16), k)
    mapped = jnp.einsum("tkgh,skh->tkgs", map_heads(jnp.asarray(q), jnp.asarray(q_map)).reshape(512, 2, 3, 16),
                        map_heads(jnp.asarray(k), jnp.asarray(k_map)))
    np.testing.assert_allclose(mapped, scores, rtol=1e-3, atol=1e-3 * float(jnp.abs(scores).max()))


def test_balance_is_the_identity_when_k_and_q_look_alike():
    rng = np.random.default_rng(0)
    k, q = rng.standard_normal((20000, 8)), rng.standard_normal((20000, 8))
    b = balance_matrix(k, q)
    np.testing.assert_allclose(b, np.eye(8), atol=0.05)
    assert abs(np.linalg.det(b) - 1) < 1e-9


def test_calibrated_maps_lower_the_int4_score_error():
    """On keys and queries drawn like the calibration's (another sample), scores through a quantized K:
    the calibrated maps against the rotation alone."""
    k_map, q_map = int4_kv_maps(*_anisotropic_kq(sample_seed=0), kv_rotation(16))
    k, q = (jnp.asarray(x) for x in _anisotropic_kq(T=256, sample_seed=1))
    r_KHH = jnp.broadcast_to(jnp.asarray(kv_rotation(16)), (2, 16, 16))
    scores = jnp.einsum("tkgh,skh->tkgs", q.reshape(256, 2, 3, 16), k)

    def score_error(km, qm):
        k_hat = dequantize_kv(*quantize_kv(map_heads(k, km), 4), 4, jnp.float32)
        got = jnp.einsum("tkgh,skh->tkgs", map_heads(q, qm).reshape(256, 2, 3, 16), k_hat)
        return float(jnp.abs(got - scores).mean())
    calibrated, rotated = score_error(jnp.asarray(k_map), jnp.asarray(q_map)), score_error(r_KHH, r_KHH)
    assert calibrated < 0.85 * rotated, (calibrated, rotated)  # measured 0.76-0.77 over three samples


def test_clip_search_never_raises_the_error_and_sometimes_lowers_it():
    x = jax.random.normal(jax.random.key(0), (64, 4, 32))
    x = x.at[:, :, 7].mul(6.0)  # an outlier channel: clipping it can pay
    plain, clipped = (dequantize_kv(*quantize_kv(x, 4, ratios), 4, jnp.float32) for ratios in ((1.0,), K_CLIP_RATIOS))
    err_plain, err_clipped = (jnp.sum((y - x) ** 2, axis=-1) for y in (plain, clipped))
    assert bool(jnp.all(err_clipped <= err_plain + 1e-6))
    assert float(err_clipped.mean()) < float(err_plain.mean()) and int(jnp.sum(err_clipped < err_plain - 1e-6)) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny_kv4"))


def test_calibration_records_every_layer_and_leaves_the_model_as_it_was(tiny):
    from lmjax.loader.model_loader import load_model
    from lmjax.models.kv_calibration import calibrate_kv_int4

    model = load_model(tiny, "float32").model
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    ids = list(np.random.default_rng(0).integers(4, 256, 200))
    maps = calibrate_kv_int4(model, ids)
    assert len(maps) == 2 and all(m.shape == (2, 16, 16) for pair in maps for m in pair)
    for k_map, q_map in maps:
        np.testing.assert_allclose(np.einsum("khi,kgi->khg", k_map, q_map), np.broadcast_to(np.eye(16), (2, 16, 16)),
                                   atol=1e-4)
    assert not any(layer.self_attn.record_queries for layer in model.layers)
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))  # nothing sown is left behind
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    again = calibrate_kv_int4(model, ids)
    jax.tree.map(np.testing.assert_array_equal, maps, again)
    with pytest.raises(ValueError, match=r"at least 64 tokens \(4 x head_dim 16\) within the model's context, got 63"):
        calibrate_kv_int4(model, ids[:63])


def test_engine_calibrates_its_int4_cache(tiny):
    from lmjax.config import EngineConfig, SamplingParams
    from lmjax.engine.engine import LLMEngine
    from lmjax.loader.model_loader import load_model
    from lmjax.models.kv_calibration import calibrate_kv_int4, calibration_ids

    engine = LLMEngine(tiny, EngineConfig(dtype="float32", quant_policy=4, block_size=16, num_gpu_blocks=32,
                                          max_batch_size=4, session_len=128))
    assert engine.load_seconds["kv_calibration"] > 0
    want = calibrate_kv_int4(load_model(tiny, "float32").model, calibration_ids(engine.tokenizer))
    for (k_cache, v_cache), (k_map, q_map) in zip(engine.runner.caches, want):
        assert isinstance(k_cache, QuantKV) and k_cache.bits == 4
        np.testing.assert_allclose(k_cache.k_map_KHH, k_map, atol=1e-6)
        np.testing.assert_allclose(k_cache.q_map_KHH, q_map, atol=1e-6)
        assert v_cache.k_map_KHH is None
    req = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(req.completions[0].token_ids) == 6


def test_caches_without_calibration_carry_the_rotation_and_int8_none():
    (k4, v4), = make_quant_kv_caches(1, 2, 8, 2, 16, 4)
    r = kv_rotation(16)
    np.testing.assert_array_equal(k4.k_map_KHH, np.broadcast_to(r, (2, 16, 16)))
    np.testing.assert_array_equal(k4.q_map_KHH, np.broadcast_to(r, (2, 16, 16)))
    (k8, _), = make_quant_kv_caches(1, 2, 8, 2, 16, 8)
    assert k8.k_map_KHH is None and v4.k_map_KHH is None
    with pytest.raises(ValueError, match="kv_maps has 2 layers' maps, the model 1 layers"):
        make_quant_kv_caches(1, 2, 8, 2, 16, 4, kv_maps=[(r, r), (r, r)])


def test_an_int4_cache_without_maps_is_named_not_read_another_way():
    from lmjax.layers.attention import contiguous_metadata, paged_attention, write_kv

    (k4, v4), = make_quant_kv_caches(1, 4, 8, 2, 16, 4)
    bare = QuantKV(k4.data_PSKW, k4.scale_PSK, k4.zero_PSK, 4, k4.compute_dtype)
    meta = contiguous_metadata([3], 8, 4)
    k = jnp.ones((3, 2, 16))
    with pytest.raises(ValueError, match="an int4 K cache needs its k_map / q_map"):
        write_kv(bare, v4, k, k, meta.slot_mapping_T)
    with pytest.raises(ValueError, match="an int4 K cache needs its k_map / q_map"):
        paged_attention(jnp.ones((3, 4, 16)), bare, v4, meta, sm_scale=0.25, impl="reference")


def test_too_short_a_context_to_calibrate_keeps_the_rotation(tmp_path, caplog):
    """(Review 33) maps fitted to fewer tokens than a few per head dimension read the cache worse than the
    rotation alone: an engine whose model's context holds too few (here 48 < 4 x 16) keeps the rotation."""
    from lmjax.config import EngineConfig, SamplingParams
    from lmjax.engine.engine import LLMEngine
    from conftest import write_tiny_llama
    from lmjax.layers.kv_quant import default_kv_maps

    path = write_tiny_llama(tmp_path / "short", max_position_embeddings=48)
    with caplog.at_level("WARNING", logger="lmjax.engine"):
        engine = LLMEngine(path, EngineConfig(dtype="float32", quant_policy=4, block_size=16, num_gpu_blocks=16,
                                              max_batch_size=2, session_len=48))
    assert engine.kv_maps is None and "uses the uncalibrated rotation" in caplog.text
    k_map, q_map = default_kv_maps(2, 16)
    for k_cache, _ in engine.runner.caches:
        np.testing.assert_allclose(k_cache.k_map_KHH, k_map)
        np.testing.assert_allclose(k_cache.q_map_KHH, q_map)
    req = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(req.completions[0].token_ids) == 4
