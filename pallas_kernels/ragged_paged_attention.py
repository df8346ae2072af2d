"""Ragged paged attention: one op for a batch mixing decode rows and prefill chunks.

Shape letters (used as suffixes of every array name in this module):
  T  tokens in the step (padded)         N  query heads
  K  kv heads                            G  query heads per kv head (N // K)
  H  head dim                            P  cache blocks
  S  block size (tokens per block)       B  sequences (padded)
  M  max blocks per sequence             L  max context (M * S)
  V  kv splits (grid axis 2)             X  rows of q flattened (T * N)
  Z  cache slots flattened (P * S)       R  rows of a q tile (block_m)
  C  keys of a kv tile (block_n)         Q  tokens of a q tile (block_q)
  A  sequences and the padding pseudo-sequence (B + 1), padded to a power of two
  1  a broadcast axis of size one

Sequence b owns query rows cu_q_lens[b] .. cu_q_lens[b+1]-1 of q. Its context
after this step is kv_lens[b] tokens; query i of the sequence sits at absolute
position kv_lens[b] - q_len + i and attends keys j <= position (and
j > position - sliding_window when a window is set: HF Mistral semantics).
Key j of sequence b lives at k_cache[block_tables[b, j // S], j % S].

Entry points:
  ragged_paged_attention            public op (this module); impl="auto" -> kernels on GPU,
                                    the tiled XLA version elsewhere
  ragged_paged_attention_kernel     Pallas (Triton backend) kernel: ragged_paged_attention_kernel.py
  ragged_paged_prefill_mgpu         Pallas Mosaic GPU (Hopper) kernel for the rows of long prefill
                                    chunks: ragged_paged_prefill_mgpu.py. On a GPU the op runs it for
                                    sequences with >= MGPU_MIN_Q_LEN query rows, then the Triton
                                    kernel for the rest, in place in the same output buffer.
  ragged_paged_attention_reference  jnp reference: ragged_paged_attention_reference.py
All go through `validate_ragged_paged_attention` (ragged_paged_attention_reference.py). This module
re-exports the names of those modules and of _pallas_util.py, the Pallas helpers, that were defined
here before they moved: importers of pallas_kernels.ragged_paged_attention keep working.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels._validate import require
from pallas_kernels._pallas_util import (
    FLOAT_DTYPES,
    _div,
    _masked_load,
    _masked_store,
    _next_pow2,
    _num_sms,
    _on_gpu,
    _rem,
    _triton_compiler_params,
    plgpu,
)
from pallas_kernels.ragged_paged_attention_kernel import (
    _LOG2E,
    TUNABLES,
    _attention_kernel,
    _choose_config,
    _combine_splits,
    _kernel_impl,
    _kernel_jit,
    _num_tiles,
    _tile_of_program,
    ragged_paged_attention_kernel,
)
from pallas_kernels.kv_tiles import kernel_reads
from pallas_kernels.ragged_paged_prefill_mgpu import PrefillConfig, mgpu_supported, ragged_paged_prefill_mgpu
from pallas_kernels.ragged_paged_attention_reference import (
    _M_INIT,
    IMPLS,
    _reference_impl,
    _token_metadata,
    ragged_paged_attention_reference,
    validate_ragged_paged_attention,
)

__all__ = [  # the public op and, re-exported, what importers take from this module
    "ragged_paged_attention", "ragged_paged_attention_kernel", "ragged_paged_attention_reference",
    "validate_ragged_paged_attention", "IMPLS", "TUNABLES", "FLOAT_DTYPES", "plgpu",
    "_M_INIT", "_LOG2E", "_token_metadata", "_reference_impl", "_num_tiles", "_choose_config",
    "_tile_of_program", "_attention_kernel", "_combine_splits", "_kernel_impl", "_kernel_jit",
    "_triton_compiler_params", "_masked_load", "_masked_store", "_next_pow2", "_div", "_rem",
    "_on_gpu", "_num_sms",
]


# Sequences with at least this many query rows in a step go to the Mosaic GPU kernel. Each of its items
# (128 rows of one head) pays a few microseconds of q load, first K/V page and output store that short
# prompts do not amortize. H200, 16k tokens of fresh prompts, the Mosaic kernel (132 persistent CTAs) vs
# the Triton kernel: 128 tokens 155 vs 142 us (1B heads), 256: 161 vs 178, 512: 193 vs 254; 8B heads
# 210 vs 189, 220 vs 250, 266 vs 377; the op adds ~20 us (tile map, the Triton pass over skipped rows).
MGPU_MIN_Q_LEN = 512
# From this many sequences in a step (static B), persistent CTAs (one per SM) that loop over items: many
# short items (16 x 1024 tokens, 8B heads: 361 vs 398 us) but not one long chunk (2048: 82.0 vs 75.9 us).
MGPU_PERSISTENT_MIN_SEQS = 8
PREFILL_IMPLS = ("auto", "mosaic", "triton")


def use_mgpu_prefill(q_TNH, k_cache_PSKH, num_seqs, sliding_window, *, prefill_impl="auto",
                     interpret=False) -> bool:
    """Whether the op runs the Mosaic GPU prefill kernel for these static shapes: on a GPU, when the kernel
    serves the dtype and shapes, for a step with more tokens than sequences (the engine's decode calls
    have T == B; there the kernel's launch and tile map would cost ~10 us a layer for nothing: H200, 1B,
    1,000 x 128+128 tokens, 53.1k vs 58.1k out tok/s) that can hold a sequence of MGPU_MIN_Q_LEN rows.
    Rows the kernel does not take are the Triton kernel's, so this choice never changes what is computed."""
    require(prefill_impl in PREFILL_IMPLS, f"prefill_impl={prefill_impl!r} must be one of {PREFILL_IMPLS}")
    if prefill_impl == "triton" or interpret or not _on_gpu():
        return False
    num_tokens = q_TNH.shape[0]
    return (num_tokens >= MGPU_MIN_Q_LEN and num_tokens > num_seqs
            and mgpu_supported(q_TNH, k_cache_PSKH, sliding_window))


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "min_q_len"))
def kernels_merged(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1, *,
                   sm_scale, interpret=False, min_q_len=MGPU_MIN_Q_LEN):
    """The Mosaic GPU kernel for sequences of >= min_q_len rows (persistent CTAs from
    MGPU_PERSISTENT_MIN_SEQS sequences), then the Triton kernel for the other rows (and the padding
    rows' zeros) written into the same buffer. interpret=True runs both in their Pallas interpret modes
    (CPU tests; slow)."""
    args = (q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1)
    persistent = kv_lens_B.shape[0] >= MGPU_PERSISTENT_MIN_SEQS
    config = PrefillConfig(num_ctas=_num_sms() if persistent else None)
    long_TNH = ragged_paged_prefill_mgpu(*args, sm_scale=sm_scale, min_q_len=min_q_len,
                                         interpret=interpret, config=config)
    return _kernel_impl(*args, sm_scale=sm_scale, sliding_window=None, interpret=interpret,
                        skip_q_len=min_q_len, into_TNH=long_TNH)


# --------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------
def ragged_paged_attention(
    q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
    *, sm_scale: float, sliding_window: int | None = None, impl: str = "auto",
    interpret: bool = False, prefill_impl: str = "auto",
):
    """Attention of a ragged batch of queries over a paged KV cache.

    impl: "auto" runs the Pallas kernels on GPU and the XLA tiled version
    (ragged_paged_attention_tiled.py) elsewhere; "kernel" / "reference" / "tiled" force one. interpret=True runs the kernel in Pallas
    interpret mode (any backend; tests). prefill_impl: on a GPU, "auto" / "mosaic" send long prefill
    chunks to the Mosaic GPU kernel where it serves the shapes (`use_mgpu_prefill`), "triton" keeps
    every row on the Triton kernel. Returns out_TNH in q's dtype, with rows past cu_q_lens[-1] zero.

    The caches may be quantized (`QuantKV`, quant_policy 8 / 4): the Triton kernel reads the codes
    (pallas_kernels/kv_tiles.py; a power-of-two head_dim, >= 32 for int4, else "auto" takes the tiled version), the
    reference and the tiled version dequantize the blocks they read. lmjax stores int4 K (and V) mapped: q
    must come mapped the same way, and the output back (lmjax.layers.kv_quant.paged_attention_quant).
    """
    validate_ragged_paged_attention(
        q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
        sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
    use_kernel = impl == "kernel" or (impl == "auto" and (interpret or _on_gpu())
                                      and kernel_reads(k_cache_PSKH, q_TNH.shape[2]))
    args = (q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1)
    if use_kernel and use_mgpu_prefill(q_TNH, k_cache_PSKH, kv_lens_B.shape[0], sliding_window,
                                       prefill_impl=prefill_impl, interpret=interpret):
        return kernels_merged(*args, sm_scale=float(sm_scale))
    if use_kernel:
        return ragged_paged_attention_kernel(*args, sm_scale=sm_scale, sliding_window=sliding_window,
                                             interpret=interpret)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, sm_scale=sm_scale, sliding_window=sliding_window)
    # Off GPU, production runs the XLA version that skips blocks no query can see.
    from pallas_kernels.ragged_paged_attention_tiled import ragged_paged_attention_tiled

    return ragged_paged_attention_tiled(*args, sm_scale=sm_scale, sliding_window=sliding_window)
