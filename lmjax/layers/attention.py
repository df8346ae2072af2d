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

`rope_and_write_kv` is what the model calls after its q/k/v projections: RoPE of q and k plus the cache
write, as apply_rope then `write_kv`, or one fused Pallas launch (pallas_kernels.rope_kv_write).
`rope_and_write_kv_qkv` does the same from a merged [q | k | v] projection output: there the fused
kernel is the GPU default (see `kv_write_impl`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec

from lmjax import parallel
from lmjax.env import env_choice
from lmjax.layers.out_major import gemv_rows
from lmjax.layers.kv_quant import QuantKV, paged_attention_quant, quant_kv_spec, write_kv_quant
from lmjax.layers.rope import apply_rope
from pallas_kernels.ragged_paged_attention import IMPLS as ATTENTION_IMPLS
from pallas_kernels.ragged_paged_attention import PREFILL_IMPLS, ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_dense_reference
from pallas_kernels.rope import RopeSpec, inv_freq_TF
from pallas_kernels.rope_kv_write import rope_kv_write, rope_kv_write_qkv, scatter_kv_reference, split_qkv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Everything the attention layers need to know about one ragged step, as device arrays."""

    slot_mapping_T: jax.Array  # int32 cache slot each token's K/V is written to
    seq_lens_T: jax.Array  # int32 sequence length dynamic NTK uses for the token: max(prompt length, position + 1)
    kv_lens_B: jax.Array  # int32 context length of each sequence after this step (0 = padding row)
    block_tables_BM: jax.Array  # int32 block ids per sequence
    cu_q_lens_B1: jax.Array  # int32 prefix sums of query tokens per sequence


def write_kv(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T):
    """Scatter this step's K/V into their slots (in place when the cache is donated to the step)."""
    if isinstance(k_cache_PSKH, QuantKV):  # quant_policy 8 / 4: quantized on write
        return write_kv_quant(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T)
    # The cache may repeat each KV head (cache heads / k_TKH's heads times): the scatter repeats K/V.
    return scatter_kv_reference(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T)


def attention_impl(impl: str | None = None) -> str:
    """`impl`, else LMJAX_ATTENTION_IMPL (read at trace time, so kernel-vs-reference runs of one engine
    need no code change), else "auto"; one of ragged_paged_attention's IMPLS."""
    return env_choice("LMJAX_ATTENTION_IMPL", ATTENTION_IMPLS, "auto", impl, label="attention impl")


def prefill_impl(impl: str | None = None) -> str:
    """Which GPU kernel attends long prefill chunks: `impl`, else LMJAX_PREFILL_IMPL, else "auto" (the
    Mosaic GPU kernel where it serves the shapes, see pallas_kernels.ragged_paged_attention); "triton"
    keeps every row on the Triton-backend kernel."""
    return env_choice("LMJAX_PREFILL_IMPL", PREFILL_IMPLS, "auto", impl, label="prefill impl")


def kv_write_impl(impl: str | None = None, *, merged: bool = False) -> str:
    """"kernel" or "reference" for the RoPE + KV write: `impl`, else LMJAX_KV_WRITE_IMPL, else
    LMJAX_ATTENTION_IMPL (so one variable switches a whole engine to its references), else "auto".
    "auto" is the fused kernel on GPU for a merged q/k/v projection (`rope_and_write_kv_qkv`) and the XLA
    path otherwise: fed q, k and v apart, the kernel measured no faster inside the decode step (H200,
    batch 1, 2026-11-23: 1B 1.137 vs 1.107 ms, 8B 4.578 ms both) because XLA copies them out of its
    merged projection GEMM for the custom call (~120 us a step on 8B). "tiled" means the XLA path here."""
    impl = env_choice("LMJAX_KV_WRITE_IMPL", ATTENTION_IMPLS, attention_impl(), impl, label="kv write impl")
    if impl == "auto":
        return "kernel" if merged and jax.default_backend() == "gpu" else "reference"
    return "kernel" if impl == "kernel" else "reference"


def _mesh_tp():
    """The mesh a step is being traced under (`lmjax.parallel.use_mesh`) and its tp size (0: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh, 0 if mesh.empty or parallel.TP_AXIS not in mesh.axis_names else mesh.shape[parallel.TP_AXIS]


def rope_and_write_kv(q_TNH, k_TKH, v_TKH, positions_T, cache, meta: AttentionMetadata, spec: RopeSpec,
                      *, impl: str | None = None):
    """RoPE on q and k, then K/V into this step's cache slots: (rotated q_TNH, (k_cache, v_cache)).

    The kernel path (only when asked for, see `kv_write_impl`) is one fused Pallas launch
    (pallas_kernels.rope_kv_write; Pallas interpret mode off GPU, for tests). Quantized caches and steps under a tp mesh take the XLA path (apply_rope, then
    write_kv): GSPMD shards it by itself, where the kernel would need its own shard_map.
    """
    k_cache, v_cache = cache
    if kv_write_impl(impl) == "reference" or isinstance(k_cache, QuantKV) or _mesh_tp()[1] > 1:
        q_TNH, k_TKH = apply_rope(q_TNH, k_TKH, positions_T, meta.seq_lens_T, spec)
        return q_TNH, write_kv(k_cache, v_cache, k_TKH, v_TKH, meta.slot_mapping_T)
    inv_freq = inv_freq_TF(spec, meta.seq_lens_T)
    q_TNH, k_cache, v_cache = rope_kv_write(
        q_TNH, k_TKH, v_TKH, positions_T, inv_freq, spec.attention_scaling, k_cache, v_cache,
        meta.slot_mapping_T, impl="kernel", interpret=jax.default_backend() != "gpu")
    return q_TNH, (k_cache, v_cache)


def rope_and_write_kv_qkv(qkv_TXH, num_kv_heads: int, positions_T, cache, meta: AttentionMetadata,
                          spec: RopeSpec, *, shards: int = 1, impl: str | None = None):
    """`rope_and_write_kv` of a merged projection output qkv_TXH = [q | k | v] heads, or with shards > 1
    (`lmjax.layers.merge`) [q_s | k_s | v_s] blocks. The fused kernel (the default on GPU, see
    `kv_write_impl`) reads it whole; under a tp mesh of `shards` devices it runs in shard_map, each device
    on its own block and cache heads. Other paths put the heads in order and split them first."""
    mesh, tp = _mesh_tp()
    if tp > 1 and shards == tp and cache[0].shape[2] == num_kv_heads and not isinstance(cache[0], QuantKV):
        local = functools.partial(_write_merged, num_kv_heads=num_kv_heads // tp, spec=spec, impl=impl)
        heads_spec = PartitionSpec(None, parallel.TP_AXIS, None)
        cache_spec = (PartitionSpec(None, None, parallel.TP_AXIS, None),) * 2
        sharded = parallel.shard_map(local, mesh, in_specs=(heads_spec, PartitionSpec(), cache_spec, PartitionSpec()),
                                     out_specs=(heads_spec, cache_spec))
        return sharded(qkv_TXH, positions_T, cache, meta)
    if shards > 1:
        qkv_TXH = unshard_qkv(qkv_TXH, num_kv_heads, shards)
    if tp > 1:  # outside shard_map only the XLA path shards (GSPMD); the kernel would see global arrays
        impl = "reference"
    return _write_merged(qkv_TXH, positions_T, cache, meta, num_kv_heads=num_kv_heads, spec=spec, impl=impl)


def qkv_gemv_takes_rope(cache, spec: RopeSpec, num_kv_heads: int, head_dim: int, T: int) -> bool:
    """Whether an out-major q/k/v GEMV of T rows also does RoPE and the KV write (pallas_kernels.gemv_om_qkv):
    where the fused RoPE + KV-write kernel would run (`kv_write_impl`, merged), on a float cache with one
    head per KV head, full rotary, no tp mesh; LMJAX_QKV_ROPE_FUSION=off keeps them apart (A/B runs)."""
    k_cache = cache[0]
    wanted = env_choice("LMJAX_QKV_ROPE_FUSION", ("auto", "off"), "auto", label="qkv rope fusion") == "auto"
    return (wanted and gemv_rows(T) and kv_write_impl(merged=True) == "kernel" and not isinstance(k_cache, QuantKV)
            and _mesh_tp()[1] <= 1 and k_cache.shape[2] == num_kv_heads and spec.rotary_dim == head_dim)


def unshard_qkv(qkv_TXH, num_kv_heads: int, shards: int):
    """[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...] blocks (each of n q and k KV heads) -> [q | k | v] heads."""
    T, X, H = qkv_TXH.shape
    k = num_kv_heads // shards
    blocks_TSYH = qkv_TXH.reshape(T, shards, X // shards, H)
    n = blocks_TSYH.shape[2] - 2 * k
    parts = (blocks_TSYH[:, :, :n], blocks_TSYH[:, :, n:n + k], blocks_TSYH[:, :, n + k:])
    return jnp.concatenate([p.reshape(T, -1, H) for p in parts], axis=1)


def _write_merged(qkv_TXH, positions_T, cache, meta: AttentionMetadata, *, num_kv_heads: int, spec: RopeSpec,
                  impl: str | None):
    """The merged [q | k | v] RoPE + KV write on the heads at hand (all of them, or one device's)."""
    k_cache, v_cache = cache
    if kv_write_impl(impl, merged=True) == "reference" or isinstance(k_cache, QuantKV):
        q_TNH, k_TKH, v_TKH = split_qkv(qkv_TXH, num_kv_heads)
        q_TNH, k_TKH = apply_rope(q_TNH, k_TKH, positions_T, meta.seq_lens_T, spec)
        return q_TNH, write_kv(k_cache, v_cache, k_TKH, v_TKH, meta.slot_mapping_T)
    q_TNH, k_cache, v_cache = rope_kv_write_qkv(
        qkv_TXH, num_kv_heads, positions_T, inv_freq_TF(spec, meta.seq_lens_T), spec.attention_scaling,
        k_cache, v_cache, meta.slot_mapping_T, impl="kernel", interpret=jax.default_backend() != "gpu")
    return q_TNH, (k_cache, v_cache)


def paged_attention(q_TNH, k_cache_PSKH, v_cache_PSKH, meta: AttentionMetadata, *, sm_scale: float,
                    sliding_window: int | None = None, impl: str | None = None):
    """Causal attention of this step's queries over each sequence's cached context.

    impl: "auto" (Pallas kernel on GPU, the XLA tiled op elsewhere), "kernel" or "reference"; by default
    the LMJAX_ATTENTION_IMPL environment variable, read at trace time, so kernel-vs-reference runs of
    the same engine need no code change.
    """
    impl = attention_impl(impl)
    quantized = isinstance(k_cache_PSKH, QuantKV)

    def attend(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1):
        if quantized:  # int4 queries rotated like the stored K, then the same op (see lmjax.layers.kv_quant)
            return paged_attention_quant(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM,
                                         cu_q_lens_B1, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
        fast = functools.partial(ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window,
                                 impl=impl, prefill_impl=prefill_impl())
        # Even the scan reference ("reference") takes the dense one's derivatives: its own keep a copy of
        # every block per query token (see ragged_paged_attention_dense_reference).
        reference = functools.partial(ragged_paged_attention_dense_reference, sm_scale=sm_scale,
                                      sliding_window=sliding_window)
        return _with_reference_derivatives(fast, reference)(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B,
                                                    block_tables_BM, cu_q_lens_B1)

    args = (q_TNH, k_cache_PSKH, v_cache_PSKH, meta.kv_lens_B, meta.block_tables_BM, meta.cu_q_lens_B1)
    mesh, tp = _mesh_tp()
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


def _with_reference_derivatives(fast, reference):
    """`fast` (the Pallas kernel, or the XLA tiled op's loop with dynamic bounds: neither has a derivative
    rule) with the derivatives of `reference` (dense masked attention over each sequence's gathered K/V,
    ragged_paged_attention_dense_reference): jax.jvp and, by JAX's transposition of the linear part,
    jax.grad through the model work with the default attention (researchers' gradients), in the memory of
    dense attention; the forward pass is unchanged. The lengths and block tables are integers: no tangents."""
    @jax.custom_jvp
    def op(q, k, v, kv_lens, tables, cu):
        return fast(q, k, v, kv_lens, tables, cu)

    @op.defjvp
    def op_jvp(primals, tangents):
        q, k, v, kv_lens, tables, cu = primals
        _, out_dot = jax.jvp(lambda q, k, v: reference(q, k, v, kv_lens, tables, cu), (q, k, v), tangents[:3])
        return fast(*primals), out_dot
    return op


def cost_follows_context(impl: str | None = None) -> bool:
    """True when attention's cost follows each sequence's real context, not the block table's width
    (the XLA tiled path off GPU loops over the blocks a tile can see). Then the engine pads every block
    table to one width and saves the compilations of width buckets. The Pallas kernel sizes its
    KV splits from the width, and the reference scans all of it: both keep width buckets."""
    impl = attention_impl(impl)
    return impl == "tiled" or (impl == "auto" and jax.default_backend() != "gpu")


def contiguous_metadata(lengths: list[int], block_size: int, num_blocks: int,
                        capacity: list[int] | None = None) -> AttentionMetadata:
    """Metadata for prefilling whole sequences into freshly laid-out blocks (1, 2, ... in order), each
    sequence owning blocks for `capacity` tokens (default: its length) so decoding can continue there.

    For tests and notebooks that run the model outside the engine; block 0 stays the padding sink.
    """
    return jax.tree.map(jnp.asarray, contiguous_metadata_host(lengths, block_size, num_blocks, capacity))


def contiguous_metadata_host(lengths: list[int], block_size: int, num_blocks: int,
                             capacity: list[int] | None = None) -> AttentionMetadata:
    """`contiguous_metadata` as int32 numpy arrays, to pad before they go to the device (jnp.asarray
    compiles a small program for every new shape)."""
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
        slot_mapping_T=np.concatenate(slots).astype(np.int32),
        seq_lens_T=np.repeat(lengths, lengths).astype(np.int32),
        kv_lens_B=np.asarray(lengths, np.int32),
        block_tables_BM=tables_BM,
        cu_q_lens_B1=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
    )
