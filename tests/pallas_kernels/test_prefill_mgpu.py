"""The Mosaic GPU prefill kernel and how the public op merges it with the Triton kernel.

On CPU both kernels run in their Pallas interpret modes (the Mosaic GPU interpreter starts every output
as NaN, so a row the kernel should write and did not fails the finiteness check); on a GPU compiled.
Caches are poisoned with a large finite value where no sequence owns a slot (the Mosaic GPU kernel
reads whole pages and masks scores; see its module docstring for why it needs finite garbage).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels import ragged_paged_prefill_mgpu as mg
from pallas_kernels.ragged_paged_attention_kernel import _kernel_impl
from rpa_cases import make_case, rel_err

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _case(q_lens, kv_lens, *, n=2, k=1, h=64, s=64, seed=0, poison=1e3, pad_tokens=0):
    rng = np.random.default_rng(seed)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=n, num_kv_heads=k, head_dim=h, block_size=s,
                     pad_tokens=pad_tokens, poison=poison)
    args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args()]
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    ref = np.asarray(rpa.ragged_paged_attention_reference(*f32, sm_scale=1 / np.sqrt(h)))
    return case, args, ref


def _rows(cu, predicate):
    """Query rows of the sequences whose q_len satisfies `predicate`."""
    rows = [np.arange(cu[b], cu[b + 1]) for b in range(len(cu) - 1) if predicate(cu[b + 1] - cu[b])]
    return np.concatenate(rows) if rows else np.zeros(0, int)


def test_prefill_tiles_cover_each_long_sequence_once():
    q_lens, kv_lens = [3, 200, 1, 64, 0, 130], [3, 250, 9, 64, 0, 1000]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    G = mg.num_prefill_tiles(int(cu[-1]), len(q_lens), 2)
    tiles = np.asarray(mg.prefill_tiles(jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), num_tiles=G,
                                        min_q_len=2))
    covered = np.zeros(cu[-1], int)
    live = tiles[5, 0]
    assert (tiles[5] == live).all() and (tiles[3, live:] == tiles[2, live:]).all(), "idle tiles come last"
    for seq, row0, lo, hi, pos0, _ in tiles.T:
        assert row0 % 8 == 0 and 0 <= lo <= hi <= 128
        for r in range(lo, hi):
            t = row0 + r
            assert cu[seq] <= t < cu[seq + 1], "a valid row must belong to the tile's sequence"
            assert pos0 + r == kv_lens[seq] - (cu[seq + 1] - t), "row position"
            covered[t] += 1
    long_rows = _rows(cu, lambda q: q >= 2)
    assert (covered[long_rows] == 1).all() and covered.sum() == len(long_rows)


@pytest.mark.parametrize("num_ctas", [2])  # one CTA per item: test_merged_kernels_match_reference
def test_mgpu_kernel_matches_reference(num_ctas):
    """Unaligned sequence starts, steps of two pages (block_kv 128 over 64-slot blocks), rows on the
    causal diagonal and on cached context, persistent CTAs carrying the K/V ring across items; decode
    rows are left to the other kernel."""
    case, args, ref = _case([3, 100, 1, 56], [3, 100, 5, 200], seed=num_ctas)
    op = jax.jit(functools.partial(mg.ragged_paged_prefill_mgpu, sm_scale=1 / np.sqrt(64), interpret=INTERPRET,
                                   config=mg.PrefillConfig(block_kv=128, num_ctas=num_ctas)))
    out = np.asarray(op(*args).astype(jnp.float32))
    rows = _rows(case.cu_q_lens_B1, lambda q: q >= 2)
    assert np.isfinite(out[rows]).all(), "a row of a prefill sequence was not written"
    assert rel_err(out[rows], ref[rows]) < 1e-2


def test_triton_kernel_leaves_skipped_sequences_alone():
    """With skip_q_len the Triton kernel writes only shorter sequences and padding rows, in place in
    the given buffer (one split) or merged after the split combine (several)."""
    case, args, ref = _case([70, 1, 9, 64], [70, 33, 40, 90], n=4, k=2, pad_tokens=4)
    into = jnp.full(args[0].shape, jnp.nan, args[0].dtype)
    long_rows = _rows(case.cu_q_lens_B1, lambda q: q >= 64)
    short_rows = _rows(case.cu_q_lens_B1, lambda q: q < 64)
    for config in (None, dict(num_splits=2, block_n=16)):
        out = _kernel_impl(*args, sm_scale=1 / np.sqrt(64), sliding_window=None, interpret=INTERPRET,
                           config=config, skip_q_len=64, into_TNH=into)
        out = np.asarray(out.astype(jnp.float32))
        assert np.isnan(out[long_rows]).all(), "rows of skipped sequences must be the buffer's"
        assert rel_err(out[short_rows], ref[short_rows]) < 1e-2
        assert (out[int(case.cu_q_lens_B1[-1]):] == 0).all(), "padding rows must be zero"


def test_merged_kernels_match_reference():
    """The op's GPU path: both kernels into one buffer, every row written once (a lower threshold than
    the op's 512 rows keeps the interpreted case small)."""
    case, args, ref = _case([1, 70, 2, 0], [20, 150, 9, 0], pad_tokens=7)
    out = rpa.kernels_merged(*args, sm_scale=1 / np.sqrt(64), interpret=INTERPRET, min_q_len=64)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


def test_op_uses_mosaic_only_where_it_serves():
    q = jnp.zeros((rpa.MGPU_MIN_Q_LEN, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 64, 2, 128), jnp.bfloat16)
    assert rpa.use_mgpu_prefill(q, cache, 8, None) == ON_GPU
    assert not rpa.use_mgpu_prefill(q, cache, rpa.MGPU_MIN_Q_LEN, None)  # T == B: a decode call
    assert not rpa.use_mgpu_prefill(q, cache, 8, None, prefill_impl="triton")
    assert not rpa.use_mgpu_prefill(q, cache, 8, 32)  # sliding window: Triton
    assert not rpa.use_mgpu_prefill(q.astype(jnp.float32), cache.astype(jnp.float32), 8, None)
    assert not rpa.use_mgpu_prefill(q, jnp.zeros((4, 16, 2, 128), jnp.bfloat16), 8, None)
    with pytest.raises(ValueError, match="prefill_impl='cuda'"):
        rpa.use_mgpu_prefill(q, cache, 8, None, prefill_impl="cuda")


def test_mgpu_kernel_names_bad_shapes():
    q = jnp.zeros((100, 8, 128), jnp.bfloat16)  # 100 tokens: not a multiple of 8
    cache = jnp.zeros((4, 64, 2, 128), jnp.bfloat16)
    lens = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"num_tokens % 8 == 0 \(got 100\)"):
        mg.ragged_paged_prefill_mgpu(q, cache, cache, lens, jnp.zeros((1, 2), jnp.int32),
                                     jnp.zeros((2,), jnp.int32), sm_scale=0.1)
    with pytest.raises(ValueError, match="block_kv=96"):
        mg.PrefillConfig(block_kv=96)
    q8 = jnp.zeros((128, 8, 128), jnp.bfloat16)
    cache128 = jnp.zeros((4, 128, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_kv=192 must divide or be a multiple of the cache's block_size=128"):
        mg.ragged_paged_prefill_mgpu(q8, cache128, cache128, lens, jnp.zeros((1, 2), jnp.int32),
                                     jnp.zeros((2,), jnp.int32), sm_scale=0.1, config=mg.PrefillConfig(block_kv=192))
