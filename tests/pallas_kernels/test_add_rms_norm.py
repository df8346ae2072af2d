"""Fused residual add + RMSNorm (pallas_kernels.add_rms_norm) vs its jnp reference, in Pallas interpret
mode under jax.jit on CPU; the reference vs lmjax's RMSNorm after a plain add. The model-level checks
(a tiny Llama with LMJAX_NORM_IMPL=kernel) are in tests/models/test_residual_stream.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax.layers.norm import RMSNorm
from pallas_kernels import add_rms_norm as module
from pallas_kernels.add_rms_norm import add_rms_norm, add_rms_norm_kernel, add_rms_norm_reference

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
EPS = 1e-5


def _inputs(seed, T, D, dtype, with_residual=True):
    """x and residual of different scales (so that the sum is not dominated by one), weight near 1."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)) * 3.0, dtype)
    residual = jnp.asarray(rng.standard_normal((T, D)), dtype) if with_residual else None
    weight = jnp.asarray(1.0 + 0.1 * rng.standard_normal(D), dtype)
    return x, residual, weight


@functools.cache
def _kernel():
    return jax.jit(functools.partial(add_rms_norm, eps=EPS, impl="kernel", interpret=INTERPRET))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "NaN or inf in the kernel's output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,D", [(1, 4096), (5, 96), (37, 64)])  # one row, odd D, many rows: CI time
@pytest.mark.parametrize("with_residual", [True, False])
def test_kernel_matches_reference(dtype, T, D, with_residual):
    x, residual, weight = _inputs(T * D, T, D, dtype, with_residual)
    normed, new_residual = _kernel()(x, residual, weight)
    want_normed, want_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert normed.shape == (T, D) and normed.dtype == want_normed.dtype == x.dtype
    assert new_residual.shape == (T, D) and new_residual.dtype == x.dtype
    assert _rel_err(normed, want_normed) < TOL[dtype]
    # The sum is one correctly rounded add in either: equal bit for bit.
    np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))
    # bf16: the kernel is as close to float32 math as the reference's own rounding allows.
    if dtype == "bfloat16":
        f32 = [None if a is None else a.astype(jnp.float32) for a in (x, residual, weight)]
        exact, _ = add_rms_norm_reference(f32[0] if residual is None else want_residual.astype(jnp.float32),
                                          None, f32[2], EPS)
        assert _rel_err(normed, exact) < TOL[dtype]


def test_wide_rows_and_float16():
    """D = 8192 (Llama-70B's hidden size: one row is a whole tile), fp16, a block that is all tail."""
    x, residual, weight = _inputs(1, 3, 8192, "float16")
    normed, new_residual = _kernel()(x, residual, weight)
    want_normed, want_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert _rel_err(normed, want_normed) < TOL["float16"]
    np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))


@pytest.mark.parametrize("T,D", [(37, 64), (5, 96), (3, 4096), (1, 8192)])
def test_masks_cover_every_element_once_and_stay_in_bounds(T, D):
    """The kernel's lanes (`_lanes`, what every load and store indexes): each element of [T, D] is on
    exactly one program's tile, and every masked-off lane points one past the end (row T or column D),
    where the GPU never goes and interpret mode drops the store. T = 37 at D = 64 is one 64-row block."""
    block_rows, _ = module._tiling(T, D)
    seen = np.zeros((T + 1, D + 1), np.int32)
    for program in range(-(-T // block_rows)):
        row_R, d_E, d_ok_E, ok_RE = (np.asarray(a) for a in module._lanes(program, block_rows, T, D))
        rows, cols = np.broadcast_to(row_R[:, None], ok_RE.shape), np.broadcast_to(d_E[None, :], ok_RE.shape)
        assert ((rows < T) & (cols < D) == ok_RE).all()
        assert ((rows <= T) & (cols <= D)).all() and (d_ok_E == (d_E < D)).all()
        np.add.at(seen, (rows[ok_RE], cols[ok_RE]), 1)
    assert (seen[:T, :D] == 1).all() and not seen[T].any() and not seen[:, D].any()


def test_block_longer_than_T_gives_finite_right_rows():
    x, residual, weight = _inputs(3, 37, 64, "float32")
    assert module._tiling(37, 64)[0] == 64
    normed, new_residual = _kernel()(x, residual, weight)
    want_normed, want_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert _rel_err(normed, want_normed) < TOL["float32"]
    np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))


def test_poisoned_output_fails_the_check():
    """The comparison is not vacuous: a NaN row, or rows left unnormalized, fail it."""
    x, residual, weight = _inputs(4, 5, 96, "float32")
    want, _ = add_rms_norm_reference(x, residual, weight, EPS)
    with pytest.raises(AssertionError, match="NaN"):
        _rel_err(want.at[2].set(jnp.nan), want)
    assert _rel_err(x + residual, want) > TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_is_rmsnorm_after_the_add_exactly(dtype):
    """The reference is bit for bit lmjax's RMSNorm of `x + residual` (and of x without residual), eager
    and under jit: what the model's default path computes."""
    x, residual, weight = _inputs(5, 7, 96, dtype)
    norm = RMSNorm(96, EPS, dtype=jnp.dtype(dtype))
    norm.weight[...] = weight
    def plain(x, res):  # what the model computed before add_and_norm: an add, then RMSNorm
        s = x if res is None else x + res
        return norm(s), s

    for res in (residual, None):  # eager vs eager, jit vs jit (XLA may fuse the add into the norm)
        for run, want in ((add_rms_norm_reference, plain),
                          (jax.jit(add_rms_norm_reference, static_argnums=3), jax.jit(plain))):
            for got, expected in zip(run(x, res, weight, EPS), want(x, res)):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert add_rms_norm_reference(x, None, weight, EPS)[1] is x  # no residual: no add, x itself


def test_auto_picks_the_kernel_only_on_gpu(monkeypatch):
    calls = []
    kernel = module.add_rms_norm_kernel
    monkeypatch.setattr(module, "add_rms_norm_kernel", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    x, residual, weight = _inputs(6, 2, 64, "float32")
    add_rms_norm(x, residual, weight, EPS)
    assert bool(calls) == ON_GPU
    add_rms_norm(x, residual, weight, EPS, interpret=True)  # interpret=True asks for the kernel
    add_rms_norm(x, residual, weight, EPS, impl="reference", interpret=True)
    assert len(calls) == 1 + ON_GPU


def _bad(**changes):
    x, residual, weight = _inputs(7, 4, 64, "float32")
    kw = dict(x_TD=x, residual_TD=residual, weight_D=weight, eps=EPS)
    kw.update(changes)
    return kw


@pytest.mark.parametrize("changes,match", [
    (dict(x_TD=jnp.zeros((4, 64, 1))), r"x_TD.shape=\(4, 64, 1\) must have rank 2"),
    (dict(x_TD=jnp.zeros((4, 64), jnp.int32)), r"x_TD.dtype=int32"),
    (dict(residual_TD=jnp.zeros((4, 32))), r"residual_TD.shape=\(4, 32\) must equal x_TD.shape=\(4, 64\)"),
    (dict(residual_TD=jnp.zeros((4, 64), jnp.bfloat16)), r"residual_TD.dtype=bfloat16 must equal"),
    (dict(weight_D=jnp.ones((32,))), r"weight_D.shape=\(32,\) must be \(64,\)"),
    (dict(weight_D=jnp.ones((64,), jnp.int8)), r"weight_D.dtype=int8"),
    (dict(eps=1), r"eps=1 must be a Python float"),
    (dict(eps=jnp.float32(1e-5)), r"eps=.* must be a Python float"),
    (dict(eps=-1e-5), r"eps=-1e-05 must be a Python float >= 0"),
])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_errors_name_the_bad_value(changes, match, impl):
    with pytest.raises(ValueError, match=match):
        add_rms_norm(*_bad(**changes).values(), impl=impl, interpret=True)


def test_impl_and_kernel_width_errors():
    with pytest.raises(ValueError, match="impl='fused'"):
        add_rms_norm(*_bad().values(), impl="fused")
    x = jnp.zeros((1, module.MAX_KERNEL_D * 2))
    with pytest.raises(ValueError, match=rf"x_TD.shape=\(1, {module.MAX_KERNEL_D * 2}\): the kernel takes D"):
        add_rms_norm_kernel(x, None, jnp.ones(x.shape[1:]), EPS, interpret=True)
