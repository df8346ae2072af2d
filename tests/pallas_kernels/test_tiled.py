"""The XLA tiled attention (production path off GPU) against the reference, on the kernel tests'
poisoned cases: per-row and shared-block tiles, sliding windows, padding rows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention_tiled import ragged_paged_attention_tiled
from test_ragged_paged_attention import CASES, _case, _check, _reference_f32


@pytest.mark.parametrize("rows_per_tile", [4, 64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_matches_reference(name, rows_per_tile):
    case, kw, dtype = _case(name, seed=3)
    op = jax.jit(functools.partial(ragged_paged_attention_tiled, rows_per_tile=rows_per_tile, **kw))
    out = op(*map(jnp.asarray, case.args()))
    assert out.dtype == jnp.dtype(dtype) and out.shape == case.q_TNH.shape
    _check(out, _reference_f32(case, **kw), case, dtype)


def test_tiled_is_the_cpu_default():
    from pallas_kernels import ragged_paged_attention as rpa

    case, kw, _ = _case("mixed_g4_h128_s16_padded")
    args = list(map(jnp.asarray, case.args()))
    auto = jax.jit(functools.partial(rpa.ragged_paged_attention, **kw))(*args)
    tiled = ragged_paged_attention_tiled(*args, **kw)
    if jax.default_backend() == "gpu":  # auto is the kernel there
        _check(auto, _reference_f32(case, **kw), case, "float32")
    else:
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(tiled))
