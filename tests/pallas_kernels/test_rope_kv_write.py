"""Fused RoPE + paged KV write (pallas_kernels.rope_kv_write) vs its jnp reference, in Pallas interpret
mode under jax.jit on CPU; then a tiny Llama through the engine with the fused path forced."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_tiny_llama
from pallas_kernels import rope
from pallas_kernels.rope_kv_write import rope_kv_write, rope_kv_write_qkv, rope_kv_write_reference

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
PAGE_SIZE = 4

SPECS = {  # built as tests/pallas_kernels/test_rope_kernel.py does; rotary_dim set per head_dim below
    "default": dict(),
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0, max_position_embeddings=1024),
    "llama3": dict(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192),
}


def _inputs(seed, spec, T, N, K, H, dtype, cache_heads=None, num_pages=12, rotary_dim=None):
    """Random q/k/v, positions, per-token frequencies, NaN-poisoned caches and T distinct slots
    shuffled across pages."""
    rng = np.random.default_rng(seed)
    spec = rope.RopeSpec(rotary_dim=rotary_dim or H, **SPECS[spec])
    q, k, v = (jnp.asarray(rng.standard_normal((T, heads, H)), dtype) for heads in (N, K, K))
    positions = jnp.asarray(rng.integers(0, 5000, T), jnp.int32)
    seq_lens = positions + jnp.asarray(rng.integers(1, 100, T), jnp.int32)  # dynamic NTK: some > max_pos
    cache = jnp.full((num_pages, PAGE_SIZE, cache_heads or K, H), jnp.nan, dtype)
    slots = jnp.asarray(rng.permutation(num_pages * PAGE_SIZE)[:T], jnp.int32)
    return (q, k, v, positions, rope.inv_freq_TF(spec, seq_lens)), spec.attention_scaling, (cache, cache, slots)


def _kernel(scaling):
    return jax.jit(functools.partial(rope_kv_write, attention_scaling=scaling, impl="kernel", interpret=INTERPRET))


def _run_both(args, scaling, cache_args):
    q, k, v, positions, inv_freq = args
    got = _kernel(scaling)(q, k, v, positions, inv_freq, k_cache_PSKH=cache_args[0],
                           v_cache_PSKH=cache_args[1], slot_mapping_T=cache_args[2])
    want = rope_kv_write_reference(q, k, v, positions, inv_freq, scaling, *cache_args)
    return got, want


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "NaN or inf where values were written"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _flat_slots(cache):
    P, S, C, H = cache.shape
    return np.asarray(cache.astype(jnp.float32)).reshape(P * S, C, H)


@pytest.mark.parametrize("spec,dtype,H,N,K,cache_heads", [
    ("default", "float32", 64, 4, 4, None),     # GQA 1
    ("linear", "bfloat16", 128, 8, 2, None),    # GQA 4
    ("dynamic", "float32", 128, 8, 1, None),    # GQA 8
    ("llama3", "bfloat16", 64, 16, 2, None),    # GQA 8
    ("llama3", "float32", 128, 32, 8, None),    # Llama-3-8B heads
    ("default", "bfloat16", 64, 8, 2, 4),       # cache repeats each kv head twice (tp > kv heads)
    ("default", "float32", 128, 12, 4, None),   # q heads in two programs of 8, the second half empty
])
def test_kernel_matches_reference(spec, dtype, H, N, K, cache_heads):
    args, scaling, cache_args = _inputs(0, spec, 11, N, K, H, dtype, cache_heads)
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _run_both(args, scaling, cache_args)
    assert q.dtype == q_ref.dtype and kc.shape == kc_ref.shape and kc.dtype == kc_ref.dtype
    assert _rel_err(q, q_ref) < TOL[dtype]
    written = np.asarray(cache_args[2])
    untouched = np.setdiff1d(np.arange(kc.shape[0] * kc.shape[1]), written)
    for got, want in ((kc, kc_ref), (vc, vc_ref)):
        got, want = _flat_slots(got), _flat_slots(want)
        assert _rel_err(got[written], want[written]) < TOL[dtype]
        assert np.isnan(got[untouched]).all(), "a slot no token names was written"


def test_partial_rotary_passes_other_dims_through_and_v_is_copied_exactly():
    args, scaling, cache_args = _inputs(1, "dynamic", 9, 4, 2, 64, "float32", rotary_dim=32)
    (q, kc, vc), (q_ref, kc_ref, _) = _run_both(args, scaling, cache_args)
    q_in, k_in, v_in = args[:3]
    written = np.asarray(cache_args[2])
    assert _rel_err(q, q_ref) < TOL["float32"]
    assert _rel_err(_flat_slots(kc)[written], _flat_slots(kc_ref)[written]) < TOL["float32"]
    np.testing.assert_array_equal(np.asarray(q)[..., 32:], np.asarray(q_in)[..., 32:])
    np.testing.assert_array_equal(_flat_slots(kc)[written][..., 32:], np.asarray(k_in)[..., 32:])
    np.testing.assert_array_equal(_flat_slots(vc)[written], np.asarray(v_in))


def test_engine_padding_rows_share_the_sink_slot():
    """The engine pads a step with rows of token 0 at position 0 writing slot 0 (the sink block): equal
    rows, so repeating the slot is harmless and the whole cache equals the reference's."""
    args, scaling, cache_args = _inputs(2, "default", 12, 8, 2, 64, "float32")
    q, k, v, positions, inv_freq = args
    pad = slice(8, None)  # rows 8.. are padding: copies of one row, position 0, slot 0
    q, k, v = (x.at[pad].set(x[8]) for x in (q, k, v))
    positions, inv_freq = positions.at[pad].set(0), inv_freq.at[pad].set(inv_freq[8])
    real = np.random.default_rng(2).permutation(np.arange(PAGE_SIZE, 12 * PAGE_SIZE))[:12]  # outside block 0
    slots = jnp.where(jnp.arange(12) >= 8, 0, jnp.asarray(real, jnp.int32))
    got, want = _run_both((q, k, v, positions, inv_freq), scaling, (*cache_args[:2], slots))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_repeated_slot_with_different_rows_holds_one_of_them():
    """Rows that differ but share a slot (not something the engine reads back): every element of that
    slot comes from one of the writers, the other slots equal the reference."""
    args, scaling, cache_args = _inputs(3, "default", 6, 4, 2, 64, "float32")
    slots = jnp.asarray([41, 32, 14, 0, 0, 0], jnp.int32)  # rows 0-2 their own slots, 3-5 all slot 0
    (_, kc, _), (_, kc_ref, _) = _run_both(args, scaling, (*cache_args[:2], slots))
    k_rot = rope.apply_rope_reference(args[1], args[3], args[4], scaling)
    sink = _flat_slots(kc)[0]
    assert np.any(np.isclose(sink[None], np.asarray(k_rot)[3:], rtol=1e-5, atol=1e-6), axis=0).all()
    others = np.asarray(slots[:3])
    np.testing.assert_allclose(_flat_slots(kc)[others], _flat_slots(kc_ref)[others], rtol=1e-5, atol=1e-6)


def test_merged_qkv_entry_point_equals_separate_q_k_v():
    """rope_kv_write_qkv reads q, k and v from one [T, N + 2K, H] array (a merged projection's output):
    the same results as the separate-array op, kernel and reference."""
    args, scaling, cache_args = _inputs(7, "llama3", 9, 8, 2, 64, "bfloat16")
    q, k, v, positions, inv_freq = args
    qkv = jnp.concatenate([q, k, v], axis=1)
    merged = jax.jit(functools.partial(rope_kv_write_qkv, num_kv_heads=2, attention_scaling=scaling,
                                       impl="kernel", interpret=INTERPRET))
    got = merged(qkv, positions_T=positions, inv_freq_TF=inv_freq, k_cache_PSKH=cache_args[0],
                 v_cache_PSKH=cache_args[1], slot_mapping_T=cache_args[2])
    _, want = _run_both(args, scaling, cache_args)
    ref = rope_kv_write_qkv(qkv, 2, positions, inv_freq, scaling, *cache_args, impl="reference")
    for g, w, r in zip(got, want, ref):
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(w, np.float32))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"qkv_TXH.shape=\(9, 4, 64\) must hold N \+ 2 \* num_kv_heads=2"):
        rope_kv_write_qkv(qkv[:, :4], 2, positions, inv_freq, scaling, *cache_args)


def test_out_of_range_slots_are_dropped():
    """A slot past the cache (or negative) writes nothing, as XLA's scatter drops it; the rest is written."""
    args, scaling, cache_args = _inputs(8, "default", 5, 4, 2, 64, "float32", num_pages=3)
    slots = jnp.asarray([3, 12, 7, -1, 100], jnp.int32)  # 12 slots in the cache
    (_, kc, vc), _ = _run_both(args, scaling, (*cache_args[:2], slots))
    k_rot = rope.apply_rope_reference(args[1], args[3], args[4], scaling)
    for got, want in ((kc, k_rot), (vc, args[2])):
        flat = _flat_slots(got)
        np.testing.assert_allclose(flat[[3, 7]], np.asarray(want)[[0, 2]], rtol=1e-5, atol=1e-6)
        assert np.isnan(np.delete(flat, [3, 7], axis=0)).all()


def test_auto_on_cpu_is_reference():
    if ON_GPU:
        pytest.skip("auto picks the kernel on GPU")
    args, scaling, cache_args = _inputs(4, "default", 5, 4, 2, 64, "float32")
    got = rope_kv_write(*args, scaling, *cache_args)
    want = rope_kv_write_reference(*args, scaling, *cache_args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_lowers_to_one_triton_call_for_gpu():
    """The Triton lowering rules accept the kernel (cross-platform lowering works without a GPU)."""
    args, scaling, cache_args = _inputs(5, "llama3", 64, 32, 8, 128, "bfloat16", num_pages=32)
    fn = functools.partial(rope_kv_write, attention_scaling=scaling, impl="kernel")
    lowered = jax.jit(fn).trace(*args, k_cache_PSKH=cache_args[0], v_cache_PSKH=cache_args[1],
                                slot_mapping_T=cache_args[2])
    if ON_GPU:
        lowered = lowered.lower()
    elif tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11):
        # jax 0.11 lowers Triton calls only with a GPU present; run this file with JAX_PLATFORMS=cuda there
        pytest.skip(f"jax {jax.__version__} cannot lower for CUDA without a GPU")
    else:  # jax 0.10 (CI): cross-platform lowering checks the Triton rules without a GPU
        lowered = lowered.lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("change,match", [
    (dict(v=jnp.zeros((5, 3, 64))), r"v_TKH.shape=\(5, 3, 64\) must equal k_TKH.shape=\(5, 2, 64\)"),
    (dict(k_cache=jnp.zeros((3, 4, 2, 32)), v_cache=jnp.zeros((3, 4, 2, 32))), r"head dim must be head_dim=64"),
    (dict(k_cache=jnp.zeros((3, 4, 3, 64)), v_cache=jnp.zeros((3, 4, 3, 64))), r"cache_heads=3 .* num_kv_heads=2"),
    (dict(v_cache=jnp.zeros((3, 4, 2, 64), jnp.bfloat16)), r"v_cache_PSKH.dtype=bfloat16 must equal"),
    (dict(slots=jnp.zeros((5,), jnp.float32)), r"slot_mapping_T.dtype=float32"),
    (dict(slots=jnp.zeros((4,), jnp.int32)), r"slot_mapping_T.shape=\(4,\) must be \(5,\)"),
    (dict(k_cache=jnp.zeros((3, 4, 2)), v_cache=jnp.zeros((3, 4, 2))),
     r"k_cache_PSKH.shape=\(3, 4, 2\) must have rank 4"),
    (dict(positions=jnp.zeros((5,), jnp.float32)), r"positions_T.dtype=float32"),
    (dict(scaling=jnp.float32(1.0)), r"attention_scaling=.* must be a Python float"),
])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_errors_name_the_bad_value(change, match, impl):
    rng = np.random.default_rng(0)
    kw = dict(q=jnp.asarray(rng.standard_normal((5, 4, 64)), jnp.float32), k=jnp.zeros((5, 2, 64)),
              v=jnp.zeros((5, 2, 64)), positions=jnp.zeros((5,), jnp.int32), inv_freq=jnp.ones((5, 32)),
              scaling=1.0, k_cache=jnp.zeros((3, 4, 2, 64)), v_cache=jnp.zeros((3, 4, 2, 64)),
              slots=jnp.zeros((5,), jnp.int32))
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        rope_kv_write(*kw.values(), impl=impl, interpret=True)


# ---------------------------------------------------------------- through the model
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (GQA 2, llama3 rope) with a tokenizer (conftest.write_tiny_llama, as tests/engine/test_multistep.py's)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_kvwrite"), eos_token_id=3,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def _generate(path, impl, monkeypatch):
    from flax import nnx

    from lmjax import LLM, SamplingParams
    from pallas_kernels import rope_kv_write as module

    traced = []  # kernel calls per trace: proves which path ran
    kernel = module._rope_kv_write_pallas
    monkeypatch.setattr(module, "_rope_kv_write_pallas", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", impl)  # read when the steps are traced
    # Plain layers on any backend: out-major weights (a GPU default) merge q/k/v for both paths.
    monkeypatch.setenv("LMJAX_DECODE_GEMV", "off")
    llm = LLM(path, max_model_len=128, num_scheduler_steps=4, block_size=8, max_num_batched_tokens=32)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(4, 256, n).tolist()} for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(traced) == (impl == "kernel") and llm.llm_engine.num_decode_loops > 0  # K-step loops ran
    attn = nnx.merge(llm.llm_engine.runner.graphdef, llm.llm_engine.runner.state).layers[0].self_attn
    assert (attn.qkv_proj is not None) == (impl == "kernel") == (attn.q_proj is None)  # merged for the kernel
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_engine_with_fused_kernel_matches_reference_path(tiny_llama, monkeypatch):
    """Chunked prefill (32-token steps), mixed batches and 4-step decode loops: the same greedy tokens,
    and logprobs within float32 tolerance, with the fused kernel (interpret mode) as with apply_rope +
    write_kv."""
    got = _generate(tiny_llama, "kernel", monkeypatch)
    want = _generate(tiny_llama, "reference", monkeypatch)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_layer_falls_back_for_quantized_caches_and_reads_the_env(monkeypatch):
    from lmjax.layers import attention

    monkeypatch.delenv("LMJAX_KV_WRITE_IMPL", raising=False)
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "reference")
    assert attention.kv_write_impl() == "reference"
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", "kernel")
    assert attention.kv_write_impl() == "kernel"
    assert attention.kv_write_impl("tiled") == "reference"
    # "auto": the kernel only for a merged projection on GPU
    assert attention.kv_write_impl("auto", merged=True) == ("kernel" if ON_GPU else "reference")
    assert attention.kv_write_impl("auto") == "reference"
    with pytest.raises(ValueError, match="impl='fused'"):
        attention.kv_write_impl("fused")
    # quant_policy 8: impl="kernel" still takes apply_rope + write_kv (quantize on write).
    from lmjax.layers.kv_quant import make_quant_kv_caches

    lengths, S = [5, 3], 4
    meta = attention.contiguous_metadata(lengths, S, 4)
    args, _, _ = _inputs(6, "default", 8, 4, 2, 32, "float32")
    spec = rope.RopeSpec(rotary_dim=32)
    (cache,) = make_quant_kv_caches(1, 4, S, 2, 32, 8)
    got = attention.rope_and_write_kv(*args[:4], cache, meta, spec, impl="kernel")
    want = attention.rope_and_write_kv(*args[:4], cache, meta, spec, impl="reference")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
