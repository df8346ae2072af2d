"""KV-cache quantization (LMDeploy's quant_policy 8 / 4): rounding bounds, attention over a quantized
cache (reference and tiled paths), capacity in the same memory, SmolLM2 perplexity through
`prompt_logits(quant_policy=...)`, and the engine and pipeline with quant_policy set.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax.layers import attention
from lmjax.layers.attention import contiguous_metadata
from lmjax.layers.kv_quant import (QuantKV, dequantize_kv, kv_bytes_per_token, kv_rotation, make_quant_kv_caches,
                                   quantize_kv)
from lmjax.models.forward import perplexity  # the weight tests' measure too
from test_quant import base_ppl, text_ids  # noqa: F401


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_rounding_is_at_most_half_a_step(bits):
    x = 3 * jax.random.normal(jax.random.key(0), (7, 4, 64)) + 0.5
    q, scale, zero = quantize_kv(x, bits)
    assert q.dtype == jnp.uint8 and q.shape == (7, 4, 64 * bits // 8) and scale.shape == zero.shape == (7, 4)
    assert zero.dtype == jnp.uint8 and int(zero.max()) <= 2**bits - 1
    err = jnp.abs(dequantize_kv(q, scale, zero, bits, jnp.float32) - x)
    assert jnp.all(err <= scale.astype(jnp.float32)[..., None] * 0.5 + 1e-6)


def test_int4_nibble_order_and_zero_point():
    # one token, one head: codes 0..15 land in order, element 2i in the low nibble
    x = jnp.arange(16, dtype=jnp.float32)[None, None] - 5.0  # range [-5, 10]: step 1, zero point 5
    q, scale, zero = quantize_kv(x, 4)
    assert float(scale[0, 0]) == 1.0 and int(zero[0, 0]) == 5
    assert [int(b) for b in q[0, 0]] == [0 | 1 << 4, 2 | 3 << 4, 4 | 5 << 4, 6 | 7 << 4, 8 | 9 << 4, 10 | 11 << 4,
                                         12 | 13 << 4, 14 | 15 << 4]


@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotation_is_orthonormal(head_dim):
    r = kv_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-5)


def _attention_case(bits, lengths=(5, 19, 1), S=8, K=2, N=4, H=32):
    rng = np.random.default_rng(0)
    num_blocks = 1 + sum(-(-n // S) for n in lengths)
    meta = contiguous_metadata(list(lengths), S, num_blocks)
    T = sum(lengths)
    q, k, v = (jnp.asarray(rng.standard_normal((T, n, H)), jnp.float32) for n in (N, K, K))
    k = k.at[:, :, 3].mul(8.0)  # an outlier channel, as real K has
    dense = (jnp.zeros((num_blocks, S, K, H)), jnp.zeros((num_blocks, S, K, H)))
    want = attention.paged_attention(q, *attention.write_kv(*dense, k, v, meta.slot_mapping_T), meta,
                                     sm_scale=H**-0.5, impl="reference")
    (kc, vc), = make_quant_kv_caches(1, num_blocks, S, K, H, bits)
    kc, vc = jax.jit(attention.write_kv)(kc, vc, k, v, meta.slot_mapping_T)
    return q, kc, vc, meta, want, H


@pytest.mark.parametrize("bits, mean_tol, max_tol", [(8, 0.01, 0.05), (4, 0.1, 0.6)])
@pytest.mark.parametrize("impl", ["reference", "tiled"])
def test_attention_reads_the_quantized_cache(bits, mean_tol, max_tol, impl):
    q, kc, vc, meta, want, H = _attention_case(bits)
    assert isinstance(kc, QuantKV) and kc.shape == (kc.shape[0], 8, 2, H)
    got = jax.jit(lambda q, kc, vc: attention.paged_attention(q, kc, vc, meta, sm_scale=H**-0.5, impl=impl))(q, kc, vc)
    err = jnp.abs(got - want)
    assert float(err.mean()) < mean_tol and float(err.max()) < max_tol


def test_int4_rotation_lowers_the_score_error_of_an_outlier_channel():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((64, 2, 64)), jnp.float32) for _ in range(2))
    k = k.at[:, :, 5].mul(10.0)
    scores = jnp.einsum("tkh,skh->kts", q, k)

    def score_error(rotate):
        r = jnp.asarray(kv_rotation(64)) if rotate else jnp.eye(64)
        k_hat = dequantize_kv(*quantize_kv(k @ r, 4), 4, jnp.float32)
        return float(jnp.abs(jnp.einsum("tkh,skh->kts", q @ r, k_hat) - scores).mean())
    assert score_error(True) < 0.7 * score_error(False)


@pytest.mark.parametrize("bits", [8, 4])
def test_tiled_equals_reference_on_the_same_quantized_cache(bits):
    q, kc, vc, meta, _, H = _attention_case(bits)
    ref = attention.paged_attention(q, kc, vc, meta, sm_scale=H**-0.5, impl="reference")
    tiled = attention.paged_attention(q, kc, vc, meta, sm_scale=H**-0.5, impl="tiled")
    np.testing.assert_allclose(tiled, ref, atol=2e-5)


@pytest.mark.parametrize("shape", [(32, 8, 128), (30, 3, 64)])  # Llama-3-8B, SmolLM2-135M
def test_quantized_cache_holds_more_tokens_in_the_same_memory(shape):
    layers, K, H = shape
    bf16 = kv_bytes_per_token(layers, K, H, 0, jnp.bfloat16)
    blocks, S = 4, 16
    for bits, minimum in ((8, 1.9), (4, 3.5)):
        caches = make_quant_kv_caches(layers, blocks, S, K, H, bits)
        allocated = sum(c.nbytes for pair in caches for c in pair)
        assert allocated == kv_bytes_per_token(layers, K, H, bits) * blocks * S  # the formula is the truth
        assert bf16 / kv_bytes_per_token(layers, K, H, bits) >= minimum


def test_engine_cache_sizing_gives_more_blocks(smollm2_lmjax):
    from lmjax.config import EngineConfig
    from lmjax.engine.cache_sizing import kv_cache_blocks

    def blocks(policy):  # a fraction of the CPU budget, with no session-length cap in the way
        cfg = EngineConfig(cache_max_entry_count=0.05, quant_policy=policy, max_batch_size=1 << 16)
        return kv_cache_blocks(cfg, smollm2_lmjax.config, jnp.bfloat16, session_len=1 << 16)
    bf16, int8, int4 = blocks(0), blocks(8), blocks(4)
    assert int8 / bf16 >= 1.9 and int4 / bf16 >= 3.5, (bf16, int8, int4)


@pytest.mark.parametrize("bad", [3, 2, 16, -8])
def test_bad_quant_policy_names_the_value(bad):
    from lmjax.config import EngineConfig
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    with pytest.raises(ValueError, match=f"quant_policy must be the int 0, 4 or 8, got {bad}"):
        EngineConfig(quant_policy=bad)
    with pytest.raises(ValueError, match=f"quant_policy must be the int 0, 4 or 8, got {bad}"):
        TurbomindEngineConfig(quant_policy=bad).to_engine_config()
    with pytest.raises(ValueError, match=f"quant_policy={bad} is not supported"):
        make_quant_kv_caches(1, 2, 4, 1, 8, bad)


# ---------------------------------------------------------------- SmolLM2 perplexity
# KV targets of the issue: int8 within 1%, int4 within 5%. int4 is what an engine runs with
# quant_policy=4: K stored through per-layer maps calibrated on lmjax/calibration_text.py (disjoint from
# this text), K clipped, V rotated (lmjax.layers.kv_quant). Measured +2.45% (10.902 vs 10.642; KL from the
# float-KV predictions 142e-3); the Hadamard rotation alone, the engine before: +17.6%. This ~600-token
# perplexity is noisy for the question: the same method with three other Hadamard sign patterns gave
# +9.1 / +9.3 / +6.5% (KL 151-159e-3; benchmarks/kv_int4_study.py, "engine, K signs seed N"), so the
# bound guards the shipped configuration's figure, not a claim about every rotation.
@pytest.fixture(scope="module")
def kv_maps(smollm2_lmjax, smollm2_tokenizer):
    from lmjax.models.kv_calibration import calibrate_kv_int4, calibration_ids

    return calibrate_kv_int4(smollm2_lmjax.model, calibration_ids(smollm2_tokenizer))


@pytest.fixture(scope="module")
def kv_int4_ppl(smollm2_lmjax, text_ids, kv_maps) -> float:  # noqa: F811
    """The whole model's perplexity with the calibrated int4 cache (two tests read it)."""
    return perplexity(smollm2_lmjax.model, text_ids, quant_policy=4, kv_maps=kv_maps)


@pytest.mark.parametrize("bits, tolerance", [(8, 0.01), (4, 0.05)])
def test_smollm2_perplexity_with_quantized_kv(smollm2_lmjax, text_ids, base_ppl, request, bits, tolerance):  # noqa: F811
    ppl = request.getfixturevalue("kv_int4_ppl") if bits == 4 else \
        perplexity(smollm2_lmjax.model, text_ids, quant_policy=bits)
    print(f"SmolLM2 perplexity: float32 KV {base_ppl:.4f}, KV int{bits} {ppl:.4f} ({ppl / base_ppl - 1:+.2%})")
    assert ppl <= base_ppl * (1 + tolerance)
    assert ppl != base_ppl  # the quantized cache was really read


def test_smollm2_int4_calibration_beats_the_rotation_alone(smollm2_lmjax, text_ids, kv_int4_ppl):  # noqa: F811
    calibrated = kv_int4_ppl
    rotation = perplexity(smollm2_lmjax.model, text_ids, quant_policy=4)
    print(f"SmolLM2 KV int4 perplexity: calibrated {calibrated:.4f}, rotation alone {rotation:.4f}")
    assert calibrated < rotation - 0.5  # measured 10.90 vs 11.83 (both with the K clip and V rotated)


# ---------------------------------------------------------------- the engine
# On the pruned SmolLM2 (conftest.write_smollm2_pruned: real weights and tokenizer, 6 of 30 layers, a
# fifth of the compile time); the cache's effect on quality is the perplexity tests' above, whole model.
def _common_prefix_ratio(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same, total = same + n, total + max(len(x), len(y))
    return same / total


@pytest.fixture(scope="module")
def greedy_prompts(smollm2_tokenizer):
    from conftest import SMOLLM2_PROMPTS

    return [smollm2_tokenizer.encode(p) for p in SMOLLM2_PROMPTS]


def _engine_greedy(model, prompts, policy, max_tokens=16):
    from lmjax.config import EngineConfig, SamplingParams
    from lmjax.engine.engine import LLMEngine

    engine = LLMEngine(model, EngineConfig(dtype="float32", quant_policy=policy, block_size=16, num_gpu_blocks=64,
                                          max_batch_size=8, session_len=256))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    caches = engine.runner.caches
    return [list(r.completions[0].token_ids) for r in reqs], caches


def test_engine_with_int8_kv_generates_mostly_the_same_greedy_tokens(smollm2_pruned, greedy_prompts):
    base, float_caches = _engine_greedy(smollm2_pruned, greedy_prompts, 0)
    quant, caches = _engine_greedy(smollm2_pruned, greedy_prompts, 8)
    assert isinstance(caches[0][0], QuantKV) and caches[0][0].data_PSKW.dtype == jnp.uint8
    assert not isinstance(float_caches[0][0], QuantKV)
    ratio = _common_prefix_ratio(base, quant)
    print(f"greedy common-prefix ratio, KV int8 vs float: {ratio:.3f}")
    assert ratio >= 0.8, (base, quant)


def test_pipeline_with_turbomind_quant_policy_8(smollm2_pruned):
    import lmjax
    from lmjax.config import GenerationConfig
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    pipe = lmjax.pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(
        quant_policy=8, dtype="float32", session_len=256, cache_max_entry_count=0.02, max_batch_size=4))
    out = pipe(["The capital of France is"], gen_config=GenerationConfig(max_new_tokens=8, top_k=1))
    assert pipe.engine.config.quant_policy == 8
    assert isinstance(pipe.engine.runner.caches[0][0], QuantKV)
    assert len(out[0].text) > 0 and out[0].generate_token_len == 8


def test_tensor_parallel_engine_with_quantized_kv(smollm2_pruned, greedy_prompts):
    """tp = 3 shards the quantized cache on KV heads (one per device), its int4 maps too (calibrated under
    the mesh), and generates tp = 1's tokens.
    int4 only (the packed layout, W = 32 codes a row; int8 shares the sharding code): the pair of
    policies took 100 s of CI."""
    import json
    import os
    import subprocess
    import sys

    driver = os.path.join(os.path.dirname(__file__), "kv_tp_driver.py")
    spec = {"model": smollm2_pruned, "policies": [4], "prompts": greedy_prompts[:2]}
    proc = subprocess.run([sys.executable, driver, json.dumps(spec)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for policy, runs in out.items():
        one, three = runs["1"], runs["3"]
        W = 64 * int(policy) // 8
        assert three["devices"] == 3 and all(s == [32, 16, 1, W] for s in three["shard_shapes"]), three
        assert one["shard_shapes"] == [[32, 16, 3, W]]
        if policy == "4":  # the calibrated K / q maps travel with the cache, one KV head's per device
            assert one["map_shard_shapes"] == [[3, 64, 64]] and three["map_shard_shapes"] == [[1, 64, 64]] * 3
        assert _common_prefix_ratio(one["tokens"], three["tokens"]) >= 0.9, (policy, one["tokens"], three["tokens"])


def test_llm_kv_cache_dtype_int8_quantizes_the_cache(smollm2_pruned):
    """vLLM's LLM(kv_cache_dtype=...): lmjax's "int8" / "int4" are quant_policy 8 / 4. (Generation over
    a quantized cache: the engine and pipeline tests above; here only what the argument builds, since a
    generate call costs ~40 s of CI compiling.)"""
    import lmjax

    llm = lmjax.LLM(smollm2_pruned, dtype="float32", kv_cache_dtype="int4", max_model_len=128,
                    gpu_memory_utilization=0.02, max_num_seqs=4)
    assert llm.llm_engine.config.quant_policy == 4
    k_cache = llm.llm_engine.runner.caches[0][0]
    assert isinstance(k_cache, QuantKV) and k_cache.bits == 4


@pytest.mark.parametrize("bad", ["fp8", "int2"])
def test_llm_bad_kv_cache_dtype_names_the_value(bad):
    from lmjax.api.llm import kv_cache_quant_policy

    with pytest.raises(ValueError, match=f"kv_cache_dtype='{bad}' must be one of"):
        kv_cache_quant_policy(bad)
