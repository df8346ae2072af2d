"""The out-major one-row GEMV (pallas_kernels/gemv_om.py) against its jnp reference: plain, with the
add + RMSNorm prologue (with and without a residual), with the SwiGLU epilogue, for 1 and 2 tokens and
several tilings; interpret mode on CPU, compiled on a GPU. Bad shapes and tiles are named."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_om import gemv_om, gemv_om_reference

I, O = 256, 64


def _inputs(T, dtype, swiglu=False, seed=0):
    kx, kr, kg, kw = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (T, I), jnp.float32).astype(dtype)
    res = jax.random.normal(kr, (T, I), jnp.float32).astype(dtype)
    g = (1 + 0.1 * jax.random.normal(kg, (I,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(kw, (2 * O if swiglu else O, I), jnp.float32) / np.sqrt(I)).astype(dtype)
    return x, res, g, w


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: the output's rounding, the order of the sums
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "norm", "add_norm", "add_norm_swiglu"])
def test_matches_reference(mode, T, dtype):
    swiglu = mode.endswith("swiglu")
    x, res, g, w = _inputs(T, dtype, swiglu)
    kw = {}
    if mode != "plain":
        kw = dict(norm_weight_I=g, eps=1e-5, residual_TI=res if mode.startswith("add") else None)
    y, s = gemv_om(x, w, swiglu=swiglu, **kw)
    y_ref, s_ref = gemv_om_reference(x, w, swiglu=swiglu, **kw)
    assert y.shape == (T, O) and y.dtype == dtype
    _close(y, y_ref, dtype)
    if mode == "plain":
        assert s is None
    else:  # the new residual: exactly the reference's sum
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))


@pytest.mark.parametrize("config", [dict(rows=8, block_k=64), dict(rows=1, block_k=256, num_warps=8),
                                    dict(rows=16, block_k=32, num_stages=2)])
def test_tilings_agree(config):
    x, res, g, w = _inputs(1, jnp.float32, swiglu=True, seed=1)
    kw = dict(residual_TI=res, norm_weight_I=g, eps=1e-6, swiglu=True)
    _close(gemv_om(x, w, config=config, **kw)[0], gemv_om_reference(x, w, **kw)[0], jnp.float32)


def test_bad_inputs_are_named():
    x, res, g, w = _inputs(1, jnp.float32)
    with pytest.raises(ValueError, match="T=4"):
        gemv_om(jnp.zeros((4, I)), w)
    with pytest.raises(ValueError, match="input dim 128 != x's 256"):
        gemv_om(x, w[:, :128])
    with pytest.raises(ValueError, match="rows=3 must be a power of two"):
        gemv_om(x, w, config=dict(rows=3))
    with pytest.raises(ValueError, match="block_k=512 must divide I=256"):
        gemv_om(x, w, config=dict(block_k=512))
    with pytest.raises(ValueError, match=r"unknown config keys \['block_o'\]"):
        gemv_om(x, w, config=dict(block_o=64))
    with pytest.raises(ValueError, match="a residual comes with norm_weight_I"):
        gemv_om(x, w, residual_TI=res)
    with pytest.raises(ValueError, match=r"norm_weight_I shape \(128,\) != \(256,\)"):
        gemv_om(x, w, norm_weight_I=g[:128])
    with pytest.raises(ValueError, match="O=63"):
        gemv_om(x, w[:63], swiglu=True)
