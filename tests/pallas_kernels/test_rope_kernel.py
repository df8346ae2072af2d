"""RoPE Pallas kernel vs pallas_kernels.rope.apply_rope_reference (interpret mode on CPU)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rope, rope_kernel

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 1e-6, "bfloat16": 1e-2}


def _inputs(seed, num_tokens, heads, kv_heads, head_dim, spec, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, head_dim)), dtype)
    positions = jnp.asarray(rng.integers(0, 5000, num_tokens), jnp.int32)
    seq_lens = positions + jnp.asarray(rng.integers(1, 100, num_tokens), jnp.int32)
    return q, k, positions, rope.inv_freq_TF(spec, seq_lens)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


SPECS = {
    "default_full": rope.RopeSpec(rotary_dim=64),
    "llama3": rope.RopeSpec(rotary_dim=128, theta=500000.0, rope_type="llama3", factor=8.0,
                            original_max_position_embeddings=8192, attention_scaling=1.0),
    "dynamic_partial": rope.RopeSpec(rotary_dim=32, rope_type="dynamic", factor=2.0,
                                     max_position_embeddings=1024),
    "yarnlike_scaling": rope.RopeSpec(rotary_dim=64, attention_scaling=1.2),
}


@pytest.mark.parametrize("spec_name,num_tokens,heads,kv_heads,head_dim,dtype", [
    ("default_full", 37, 9, 3, 64, "float32"),
    ("llama3", 16, 8, 2, 128, "bfloat16"),
    ("dynamic_partial", 21, 4, 4, 64, "float32"),
    ("yarnlike_scaling", 5, 6, 1, 64, "bfloat16"),
])
def test_qk_kernel_matches_reference(spec_name, num_tokens, heads, kv_heads, head_dim, dtype):
    spec = SPECS[spec_name]
    q, k, positions, inv_freq = _inputs(0, num_tokens, heads, kv_heads, head_dim, spec, dtype)
    scaling = spec.attention_scaling
    fn = jax.jit(functools.partial(rope_kernel.apply_rope_qk, attention_scaling=scaling,
                                   impl="kernel", interpret=INTERPRET))
    q_out, k_out = fn(q, k, positions, inv_freq)
    for out, x in ((q_out, q), (k_out, k)):
        ref = rope.apply_rope_reference(x, positions, inv_freq, scaling)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert _rel_err(out, ref) < TOL[dtype]
        rot = 2 * inv_freq.shape[1]  # pass-through dims are untouched, bit for bit
        np.testing.assert_array_equal(np.asarray(out[..., rot:]), np.asarray(x[..., rot:]))


def test_single_tensor_kernel_matches_reference():
    spec = SPECS["default_full"]
    q, _, positions, inv_freq = _inputs(1, 12, 4, 1, 64, spec, jnp.float32)
    out = rope_kernel.apply_rope_kernel(q, positions, inv_freq, interpret=INTERPRET)
    assert _rel_err(out, rope.apply_rope_reference(q, positions, inv_freq)) < TOL["float32"]


def test_auto_on_cpu_is_reference():
    if ON_GPU:
        pytest.skip("auto picks the kernel on GPU")
    spec = SPECS["default_full"]
    q, k, positions, inv_freq = _inputs(2, 7, 4, 2, 64, spec, jnp.float32)
    q_out, _ = rope_kernel.apply_rope_qk(q, k, positions, inv_freq)
    np.testing.assert_array_equal(np.asarray(q_out),
                                  np.asarray(rope.apply_rope_reference(q, positions, inv_freq)))


@pytest.mark.parametrize("change,match", [
    (dict(positions=jnp.zeros((7,), jnp.float32)), "positions_T.dtype=float32"),
    (dict(inv_freq=jnp.zeros((7, 32), jnp.bfloat16)), "inv_freq_TF.dtype=bfloat16"),
    (dict(k=jnp.zeros((7, 2, 32), jnp.float32)), "head_dim=32"),
    (dict(impl="triton"), "impl='triton'"),
])
def test_validator_names_bad_value(change, match):
    args = dict(q=jnp.zeros((7, 4, 64), jnp.float32), k=jnp.zeros((7, 2, 64), jnp.float32),
                positions=jnp.zeros((7,), jnp.int32), inv_freq=jnp.zeros((7, 32), jnp.float32),
                impl="kernel")
    args.update(change)
    impl = args.pop("impl")
    with pytest.raises(ValueError, match=match):
        rope_kernel.apply_rope_qk(*args.values(), impl=impl, interpret=True)
