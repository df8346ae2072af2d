"""Paged attention for the model: the per-step metadata pytree, the KV-cache write, and one attention
call that runs the Pallas kernel on GPU and its jnp reference elsewhere (pallas_kernels decides).

Shape letters: T tokens in the step (padded), N query heads, K kv heads, H head dim, P cache blocks,
S block size, B sequences (padded), M max blocks per sequence.

The cache of one layer is a pair (k_PSKH, v_PSKH). Slot s of the cache is block s // S, offset s % S;
padding tokens write into block 0, which the block manager never hands out.

Tensor parallelism stays out of the model: when the step runs under a mesh with a "tp" axis
(`lmjax.parallel.use_mesh`), `paged_attention` wraps the op in shard_map over the head axis, so each
device attends its own query heads over its own KV-cache heads. A cache may store each KV head r times
(r = cache heads / K, see `lmjax.parallel.kv_cache_heads`); `write_kv` repeats K/V to match.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec

from lmjax import parallel
from lmjax.layers.quant import QuantKV, paged_attention_quant, quant_kv_spec, write_kv_quant
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Everything the attention layers need to know about one ragged step, as device arrays."""

    slot_mapping_T: jax.Array  # int32 cache slot each token's K/V is written to
    seq_lens_T: jax.Array  # int32 length of the token's sequence after this step (dynamic NTK)
    kv_lens_B: jax.Array  # int32 context length of each sequence after this step (0 = padding row)
    block_tables_BM: jax.Array  # int32 block ids per sequence
    cu_q_lens_B1: jax.Array  # int32 prefix sums of query tokens per sequence


def write_kv(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T):
    """Scatter this step's K/V into their slots (in place when the cache is donated to the step)."""
    if isinstance(k_cache_PSKH, QuantKV):  # quant_policy 8 / 4: quantized on write
        return write_kv_quant(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T)
    P, S, K, H = k_cache_PSKH.shape
    if K != k_TKH.shape[1]:  # the cache repeats each KV head K / k_TKH.shape[1] times
        repeats = K // k_TKH.shape[1]
        k_TKH, v_TKH = jnp.repeat(k_TKH, repeats, axis=1), jnp.repeat(v_TKH, repeats, axis=1)
    k_flat = k_cache_PSKH.reshape(P * S, K, H).at[slot_mapping_T].set(k_TKH.astype(k_cache_PSKH.dtype))
    v_flat = v_cache_PSKH.reshape(P * S, K, H).at[slot_mapping_T].set(v_TKH.astype(v_cache_PSKH.dtype))
    return k_flat.reshape(P, S, K, H), v_flat.reshape(P, S, K, H)


def paged_attention(q_TNH, k_cache_PSKH, v_cache_PSKH, meta: AttentionMetadata, *, sm_scale: float,
                    sliding_window: int | None = None, impl: str | None = None):
    """Causal attention of this step's queries over each sequence's cached context.

    impl: "auto" (Pallas kernel on GPU, jnp reference elsewhere), "kernel" or "reference"; by default
    the LMJAX_ATTENTION_IMPL environment variable, read at trace time, so kernel-vs-reference runs of
    the same engine need no code change.
    """
    impl = impl or os.environ.get("LMJAX_ATTENTION_IMPL", "auto")
    quantized = isinstance(k_cache_PSKH, QuantKV)

    def attend(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1):
        if quantized:  # the reference or the XLA tiled op, both dequantizing (see lmjax.layers.quant)
            return paged_attention_quant(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                                         cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
        return ragged_paged_attention(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                                      cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)

    args = (q_TNH, k_cache_PSKH, v_cache_PSKH, meta.kv_lens_B, meta.block_tables_BM, meta.cu_q_lens_B1)
    mesh = jax.sharding.get_abstract_mesh()
    tp = 0 if mesh.empty or parallel.TP_AXIS not in mesh.axis_names else mesh.shape[parallel.TP_AXIS]
    if tp <= 1:
        return attend(*args)
    N, K = q_TNH.shape[1], k_cache_PSKH.shape[2]
    if N % tp or K % tp:
        raise ValueError(f"under a mesh with tp={tp}, q heads N={N} and KV-cache heads K={K} must both be "
                         "divisible by tp (build caches with lmjax.parallel.make_kv_caches)")
    heads = parallel.TP_AXIS
    q_spec, cache_spec = PartitionSpec(None, heads, None), PartitionSpec(None, None, heads, None)
    if quantized:
        cache_spec = quant_kv_spec(k_cache_PSKH)
    sharded = parallel.shard_map(attend, mesh, in_specs=(q_spec, cache_spec, cache_spec) + (PartitionSpec(),) * 3,
                                 out_specs=q_spec)
    return sharded(*args)


def cost_follows_context(impl: str | None = None) -> bool:
    """True when attention's cost follows each sequence's real context, not the block table's width
    (the XLA tiled path off GPU loops over the blocks a tile can see). Then the engine pads every block
    table to one width and saves the compilations of width buckets. The Pallas kernel sizes its
    KV splits from the width, and the reference scans all of it: both keep width buckets."""
    impl = impl or os.environ.get("LMJAX_ATTENTION_IMPL", "auto")
    return impl == "tiled" or (impl == "auto" and jax.default_backend() != "gpu")


def contiguous_metadata(lengths: list[int], block_size: int, num_blocks: int,
                        capacity: list[int] | None = None) -> AttentionMetadata:
    """Metadata for prefilling whole sequences into freshly laid-out blocks (1, 2, ... in order), each
    sequence owning blocks for `capacity` tokens (default: its length) so decoding can continue there.

    For tests and notebooks that run the model outside the engine; block 0 stays the padding sink.
    """
    import numpy as np

    blocks_per_seq = [-(-n // block_size) for n in (capacity or lengths)]
    if 1 + sum(blocks_per_seq) > num_blocks:
        raise ValueError(f"{num_blocks=} too small for lengths {lengths} at {block_size=}")
    M = max(blocks_per_seq)
    tables_BM = np.zeros((len(lengths), M), np.int32)
    slots, next_block = [], 1
    for b, (n, nb) in enumerate(zip(lengths, blocks_per_seq)):
        tables_BM[b, :nb] = np.arange(next_block, next_block + nb)
        pos = np.arange(n)
        slots.append(tables_BM[b, pos // block_size] * block_size + pos % block_size)
        next_block += nb
    return AttentionMetadata(
        slot_mapping_T=jnp.asarray(np.concatenate(slots), jnp.int32),
        seq_lens_T=jnp.asarray(np.repeat(lengths, lengths), jnp.int32),
        kv_lens_B=jnp.asarray(lengths, jnp.int32),
        block_tables_BM=jnp.asarray(tables_BM),
        cu_q_lens_B1=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
    )
