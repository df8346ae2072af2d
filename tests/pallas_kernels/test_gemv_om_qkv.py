"""The fused q/k/v GEMV + RoPE + KV write (pallas_kernels/gemv_om_qkv.py) against the unfused reference
(gemv_om_reference, then rope_kv_write_reference): rotated q, both caches (written slots and untouched
ones), the new residual; 1 and 2 tokens, float32 and bf16, a slot outside the cache dropped, several
tilings. Interpret mode on CPU, compiled on a GPU. Bad inputs are named."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_om_qkv import gemv_om_qkv, gemv_om_qkv_reference

I, N, K, H = 128, 4, 2, 16
P, S = 3, 4  # cache pages x slots


def _inputs(T, dtype, seed=0, residual=True, slots=(5, 10)):
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (T, I), jnp.float32).astype(dtype)
    res = jax.random.normal(ks[1], (T, I), jnp.float32).astype(dtype) if residual else None
    g = (1 + 0.1 * jax.random.normal(ks[2], (I,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(ks[3], ((N + 2 * K) * H, I), jnp.float32) / np.sqrt(I)).astype(dtype)
    inv_freq = jnp.broadcast_to(1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)), (T, H // 2))
    caches = [jax.random.normal(k, (P, S, K, H), jnp.float32).astype(dtype) for k in ks[4:6]]
    return dict(x_TI=x, w_XI=w, residual_TI=res, norm_weight_I=g, eps=1e-5, num_kv_heads=K, head_dim=H,
                positions_T=jnp.array([7, 300][:T], jnp.int32), inv_freq_TF=inv_freq, attention_scaling=1.0,
                k_cache_PSKH=caches[0], v_cache_PSKH=caches[1],
                slot_mapping_T=jnp.array(slots[:T], jnp.int32))


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: the roundings, the order of the sums
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


def _check(args, dtype, config=None):
    q, kc, vc, s = gemv_om_qkv(**args, config=config)
    q_ref, kc_ref, vc_ref, s_ref = gemv_om_qkv_reference(**args)
    assert q.shape == (args["x_TI"].shape[0], N, H) and q.dtype == dtype
    _close(q, q_ref, dtype)
    _close(kc, kc_ref, dtype)
    _close(vc, vc_ref, dtype)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    return kc, vc


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
def test_matches_reference(T, dtype):
    args = _inputs(T, dtype)
    kc, vc = _check(args, dtype)
    written = np.zeros(P * S, bool)
    written[np.asarray(args["slot_mapping_T"])] = True
    for got, before in ((kc, args["k_cache_PSKH"]), (vc, args["v_cache_PSKH"])):
        got, before = np.asarray(got, np.float32).reshape(P * S, -1), np.asarray(before, np.float32).reshape(P * S, -1)
        np.testing.assert_array_equal(got[~written], before[~written])  # other slots kept bit for bit
        assert not np.array_equal(got[written], before[written])


def test_first_layer_without_residual_and_a_dropped_slot():
    args = _inputs(2, jnp.float32, seed=1, residual=False, slots=(3, P * S + 5))
    kc, _ = _check(args, jnp.float32)
    before = np.asarray(args["k_cache_PSKH"]).reshape(P * S, -1)
    got = np.asarray(kc).reshape(P * S, -1)
    np.testing.assert_array_equal(np.delete(got, 3, axis=0), np.delete(before, 3, axis=0))


@pytest.mark.parametrize("config", [dict(rows=1, block_k=32), dict(rows=8, block_k=128, num_warps=8),
                                    dict(rows=4, block_k=64, num_stages=2)])
def test_tilings_agree(config):
    _check(_inputs(1, jnp.float32, seed=2), jnp.float32, config)


def test_bad_inputs_are_named():
    args = _inputs(1, jnp.float32)
    with pytest.raises(ValueError, match="full rotary"):
        gemv_om_qkv(**{**args, "inv_freq_TF": args["inv_freq_TF"][:, :4]})
    with pytest.raises(ValueError, match="rows=16 must divide H/2=8"):
        gemv_om_qkv(**args, config=dict(rows=16))
    with pytest.raises(ValueError, match="takes 1..2 tokens, got T=3"):
        gemv_om_qkv(**{**args, "x_TI": jnp.zeros((3, I))})
    with pytest.raises(ValueError, match="float caches"):
        gemv_om_qkv(**{**args, "k_cache_PSKH": jnp.zeros((P, S, 2 * K, H))})
    with pytest.raises(ValueError, match="not whole heads"):
        gemv_om_qkv(**{**args, "w_XI": args["w_XI"][:-1]})
