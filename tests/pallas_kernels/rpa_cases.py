"""Random ragged batches over a poisoned paged KV cache, and a dense numpy attention.

Shape letters as in pallas_kernels/ragged_paged_attention.py. Everything the op
must not read is poisoned with NaN: block 0 (the padding sink), blocks no
sequence owns, slots past each sequence's length in its last block, and the
block-table entries past each sequence's blocks point at poisoned blocks.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedCase:
    q_TNH: np.ndarray
    k_cache_PSKH: np.ndarray
    v_cache_PSKH: np.ndarray
    kv_lens_B: np.ndarray
    block_tables_BM: np.ndarray
    cu_q_lens_B1: np.ndarray

    def args(self):
        return (self.q_TNH, self.k_cache_PSKH, self.v_cache_PSKH, self.kv_lens_B,
                self.block_tables_BM, self.cu_q_lens_B1)


def make_case(rng, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, block_size,
              pad_tokens=0, pad_seqs=0, spare_blocks=3, dtype=np.float32, poison=np.nan):
    """q_lens[b] new tokens of a sequence whose context is kv_lens[b] after the step."""
    assert all(0 <= q <= kv for q, kv in zip(q_lens, kv_lens))
    q_lens = list(q_lens) + [0] * pad_seqs
    kv_lens = list(kv_lens) + [0] * pad_seqs
    blocks_B = [-(-kv // block_size) for kv in kv_lens]
    max_blocks = max(max(blocks_B), 1) + 1  # one spare column of garbage entries
    num_blocks = 1 + sum(blocks_B) + spare_blocks
    shuffled = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    # Unowned table entries point anywhere, block 0 and unowned blocks included.
    tables_BM = rng.integers(0, num_blocks, (len(kv_lens), max_blocks)).astype(np.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_PSKH = rng.standard_normal(cache_shape).astype(np.float32)
    v_PSKH = rng.standard_normal(cache_shape).astype(np.float32)
    written = np.zeros((num_blocks, block_size), bool)
    next_block = 0
    for b, kv in enumerate(kv_lens):
        own = shuffled[next_block:next_block + blocks_B[b]]
        next_block += blocks_B[b]
        tables_BM[b, :len(own)] = own
        for j in range(kv):
            written[own[j // block_size], j % block_size] = True
    k_PSKH[~written] = poison
    v_PSKH[~written] = poison
    num_tokens = sum(q_lens) + pad_tokens
    q_TNH = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    q_TNH[sum(q_lens):] = poison  # padding rows must not leak into real ones
    cu_B1 = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedCase(q_TNH.astype(dtype), k_PSKH.astype(dtype), v_PSKH.astype(dtype),
                     np.asarray(kv_lens, np.int32), tables_BM, cu_B1)


def dense_attention(case: PagedCase, *, sm_scale, sliding_window=None):
    """Obviously-correct float64 attention: pages gathered back to dense K/V per sequence."""
    q_TNH = np.asarray(case.q_TNH, np.float64)
    k_PSKH = np.asarray(case.k_cache_PSKH, np.float64)
    v_PSKH = np.asarray(case.v_cache_PSKH, np.float64)
    num_tokens, num_q_heads, _ = q_TNH.shape
    group = num_q_heads // k_PSKH.shape[2]
    block_size = k_PSKH.shape[1]
    out_TNH = np.zeros_like(q_TNH)
    for b, kv_len in enumerate(case.kv_lens_B):
        start, stop = case.cu_q_lens_B1[b], case.cu_q_lens_B1[b + 1]
        keys_L = np.arange(kv_len)
        blocks_L = case.block_tables_BM[b, keys_L // block_size]
        k_LKH = k_PSKH[blocks_L, keys_L % block_size]
        v_LKH = v_PSKH[blocks_L, keys_L % block_size]
        for t in range(start, stop):
            pos = kv_len - (stop - start) + (t - start)
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for n in range(num_q_heads):
                k_JH, v_JH = k_LKH[lo:pos + 1, n // group], v_LKH[lo:pos + 1, n // group]
                s_J = k_JH @ q_TNH[t, n] * sm_scale
                p_J = np.exp(s_J - s_J.max())
                out_TNH[t, n] = p_J @ v_JH / p_J.sum()
    return out_TNH


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
