"""Ragged paged attention: kernel vs reference vs dense numpy, on poisoned caches.

On CPU the kernel runs in Pallas interpret mode (jitted); on a GPU it runs
compiled, with the fp32 tolerance widened for tf32 dots.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import ragged_paged_attention as rpa
from rpa_cases import dense_attention, make_case, rel_err

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 5e-4 if ON_GPU else 1e-5, "bfloat16": 1e-2}

# name: (q_lens, kv_lens, N, K, H, S, dtype, sliding_window, pad_tokens, pad_seqs)
CASES = {
    "decode_g4_h64_s16": ([1] * 5, [1, 16, 17, 64, 100], 8, 2, 64, 16, "float32", None, 0, 0),
    "decode_g8_h128_s64_bf16_padded": ([1] * 3, [1, 64, 129], 8, 1, 128, 64, "bfloat16", None, 2, 1),
    "prefill_g1_h128_s64": ([37, 20], [37, 50], 2, 2, 128, 64, "float32", None, 0, 0),
    "prefill_g4_h64_s128_bf16_long": ([50], [300], 8, 2, 64, 128, "bfloat16", None, 0, 0),
    "mixed_g8_h64_s16_bf16": ([1, 9, 1, 30, 0], [33, 9, 128, 70, 0], 8, 1, 64, 16, "bfloat16", None, 3, 0),
    "mixed_g16_h64_s128": ([1, 12, 1], [129, 140, 5], 16, 1, 64, 128, "float32", None, 0, 1),
    "mixed_g4_h128_s16_padded": ([3, 1, 17], [16, 48, 17], 8, 2, 128, 16, "float32", None, 4, 0),
    "window8_mixed_g4_s16": ([1, 20, 1], [40, 33, 7], 8, 2, 64, 16, "float32", 8, 0, 0),
    "window33_g1_s64_bf16": ([25, 1], [90, 130], 2, 2, 64, 64, "bfloat16", 33, 1, 0),
    "window64_long_g2_s16": ([1, 30], [200, 150], 4, 2, 64, 16, "float32", 64, 0, 0),
}


def _case(name, seed=0):
    q_lens, kv_lens, n, k, h, s, dtype, window, pad_t, pad_b = CASES[name]
    rng = np.random.default_rng(seed)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=n, num_kv_heads=k, head_dim=h,
                     block_size=s, pad_tokens=pad_t, pad_seqs=pad_b, dtype=jnp.dtype(dtype))
    return case, dict(sm_scale=1.0 / np.sqrt(h), sliding_window=window), dtype


def _reference_f32(case, **kw):
    f32 = [jnp.asarray(a, jnp.float32) if a.dtype != np.int32 else jnp.asarray(a)
           for a in case.args()]
    return np.asarray(rpa.ragged_paged_attention_reference(*f32, **kw), np.float32)


def _check(out, ref, case, dtype):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in output: a poisoned slot was read"
    num_valid = int(case.cu_q_lens_B1[-1])
    assert (out[num_valid:] == 0).all(), "padding rows must be zero"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    case, kw, dtype = _case(name)
    op = jax.jit(functools.partial(rpa.ragged_paged_attention, impl="kernel",
                                   interpret=INTERPRET, **kw))
    out = op(*map(jnp.asarray, case.args()))
    assert out.dtype == jnp.dtype(dtype) and out.shape == case.q_TNH.shape
    _check(out, _reference_f32(case, **kw), case, dtype)


@pytest.mark.parametrize("name,num_splits", [("mixed_g4_h128_s16_padded", 3),
                                             ("window8_mixed_g4_s16", 4),
                                             ("window64_long_g2_s16", 2)])
def test_kernel_split_kv_matches_reference(name, num_splits):
    """The flash-decoding path (context split across programs, then merged);
    small kv tiles so that the unmasked interior loop runs too."""
    case, kw, dtype = _case(name, seed=1)
    config = dict(num_splits=num_splits, block_n=16)
    out = rpa.ragged_paged_attention_kernel(*map(jnp.asarray, case.args()), interpret=INTERPRET,
                                            config=config, **kw)
    _check(out, _reference_f32(case, **kw), case, dtype)


@pytest.mark.parametrize("name", ["mixed_g8_h64_s16_bf16", "mixed_g4_h128_s16_padded",
                                  "window8_mixed_g4_s16", "window33_g1_s64_bf16",
                                  "prefill_g4_h64_s128_bf16_long"])
def test_reference_matches_dense_numpy(name):
    case, kw, _ = _case(name, seed=2)
    ref = _reference_f32(case, **kw)
    dense = dense_attention(case, **kw)
    assert np.isfinite(ref).all()
    assert rel_err(ref, dense) < 1e-5


def test_forced_reference_is_the_reference():
    case, kw, _ = _case("decode_g4_h64_s16")
    args = list(map(jnp.asarray, case.args()))
    forced = jax.jit(functools.partial(rpa.ragged_paged_attention, impl="reference", **kw))(*args)
    ref = rpa.ragged_paged_attention_reference(*args, **kw)
    np.testing.assert_array_equal(np.asarray(forced), np.asarray(ref))


def test_tiles_cover_every_row_once():
    cu_B1 = jnp.asarray([0, 1, 1, 9, 10, 30, 30], jnp.int32)
    num_seqs, num_tokens, block_q = 6, 35, 4
    num_tiles = (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q

    def kernel(cu_ref, out_ref):
        tile = pl.program_id(0)
        seq, start, count = rpa._tile_of_program(cu_ref, tile, num_seqs, num_tokens, block_q)
        out_ref[tile, 0], out_ref[tile, 1], out_ref[tile, 2] = seq, start, count

    tiles = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((num_tiles, 3), jnp.int32),
                           grid=(num_tiles,), interpret=True)(cu_B1)
    rows = [r for _, s, c in np.asarray(tiles) for r in range(s, s + c)]
    assert sorted(rows) == list(range(num_tokens))
    bounds = list(np.asarray(cu_B1)) + [num_tokens]  # padding rows: pseudo-sequence B
    for b, s, c in np.asarray(tiles):
        if c:
            assert bounds[b] <= s and s + c <= bounds[b + 1]


# ---------------------------------------------------------------- validator
def _good_args(n=8, k=2, h=64, s=16):
    q = jnp.zeros((4, n, h), jnp.float32)
    cache = jnp.zeros((5, s, k, h), jnp.float32)
    return dict(q_TNH=q, k_cache_PSKH=cache, v_cache_PSKH=cache,
                kv_lens_B=jnp.zeros((2,), jnp.int32),
                block_tables_BM=jnp.zeros((2, 3), jnp.int32),
                cu_q_lens_B1=jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("change,kwargs,match", [
    (dict(q_TNH=jnp.zeros((4, 64), jnp.float32)), {}, r"q_TNH.shape=\(4, 64\)"),
    (dict(q_TNH=jnp.zeros((4, 7, 64), jnp.float32)), {}, "num_q_heads=7"),
    (dict(q_TNH=jnp.zeros((4, 8, 32), jnp.float32)), {}, r"k_cache_PSKH.shape=\(5, 16, 2, 64\)"),
    (dict(v_cache_PSKH=jnp.zeros((5, 16, 2, 32), jnp.float32)), {}, r"v_cache_PSKH.shape=\(5, 16, 2, 32\)"),
    (dict(q_TNH=jnp.zeros((4, 8, 64), jnp.bfloat16)), {}, "q_TNH.dtype=bfloat16"),
    (dict(q_TNH=jnp.zeros((4, 8, 64), jnp.int32)), {}, "q_TNH.dtype=int32"),
    (dict(block_tables_BM=jnp.zeros((2, 3), jnp.float32)), {}, "block_tables_BM.dtype=float32"),
    (dict(block_tables_BM=jnp.zeros((3, 3), jnp.int32)), {}, r"block_tables_BM.shape=\(3, 3\)"),
    (dict(cu_q_lens_B1=jnp.zeros((2,), jnp.int32)), {}, r"cu_q_lens_B1.shape=\(2,\)"),
    (dict(kv_lens_B=jnp.zeros((2,), jnp.int64 if jax.config.x64_enabled else jnp.float32)), {},
     "kv_lens_B.dtype"),
    ({}, dict(sm_scale=-1.0), "sm_scale=-1.0"),
    ({}, dict(sliding_window=0), "sliding_window=0"),
    ({}, dict(impl="fast"), "impl='fast'"),
])
def test_validator_names_bad_value(change, kwargs, match):
    args = {**_good_args(), **change}
    kw = {"sm_scale": 0.125, **kwargs}
    with pytest.raises(ValueError, match=match):
        rpa.ragged_paged_attention(*args.values(), **kw)


def test_kernel_validator_rejects_odd_head_dim():
    args = _good_args(h=80)
    with pytest.raises(ValueError, match="head_dim=80"):
        rpa.ragged_paged_attention(*args.values(), sm_scale=0.1, impl="kernel", interpret=True)
    # The reference takes any head_dim.
    rpa.ragged_paged_attention(*args.values(), sm_scale=0.1, impl="reference")


@pytest.mark.parametrize("batch, context, block_n, num_splits", [
    (1, 512, 128, 4),     # batch 1: the context splits (was unsplit below 4 kv tiles per split)
    (1, 8192, 128, 8),    # at most 8 splits
    (32, 2048, 128, 1),   # enough q tiles: no split, long kv tiles
    (1024, 256, 64, 1),   # thousands of programs: 64-key tiles
])
def test_gpu_decode_tiling_follows_the_h200_sweeps(monkeypatch, batch, context, block_n, num_splits):
    from pallas_kernels import ragged_paged_attention_kernel as rpa_kernel

    monkeypatch.setattr(rpa_kernel, "_num_sms", lambda: 132)  # where the tiling reads it
    cfg = rpa._choose_config(batch, batch, 32, 8, 128, context, on_gpu=True)
    assert (cfg["block_n"], cfg["num_splits"]) == (block_n, num_splits)
