"""The Mosaic GPU prefill kernel's static side: its tiling config, which shapes it serves, and the tile map
(XLA) that assigns query rows to its CTAs. Shape letters: pallas_kernels/ragged_paged_prefill_mgpu.py."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._validate import require
from pallas_kernels.quant_kv import QuantKV

try:  # Mosaic GPU Pallas; absent from some jax builds.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plgpu = None

ROWS_PER_WG = 64  # wgmma's M: query rows of one compute warpgroup
MGPU_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    block_kv: int = 128  # keys of a kv step; divides the cache block size or is a multiple of it
    max_steps: int = 2  # K/V steps in flight (shared-memory stages)
    schedule_barrier: bool = True  # ping-pong the two compute warpgroups' tensor-core phases
    # CTAs looping over the (tile, head) items; None: one CTA per item. Persistent CTAs (one per SM)
    # measured slower: 8B heads, 2048 fresh, 82.0 vs 75.9 us (H200, benchmarks/prefill_mgpu.py).
    num_ctas: int | None = None

    def __post_init__(self):
        require(self.block_kv % 64 == 0, f"block_kv={self.block_kv} must be a multiple of 64")
        require(self.max_steps >= 2, f"max_steps={self.max_steps} must be >= 2")


def mgpu_supported(q_TNH, k_cache_PSKH, sliding_window) -> bool:
    """Whether this kernel serves these (static) shapes: else the caller uses the Triton kernel. Float
    caches only (a quantized `QuantKV` cache: the Triton kernel)."""
    num_tokens, _, head_dim = q_TNH.shape
    block_size = k_cache_PSKH.shape[1]
    # TMA boxes of tiled (8-row) shared memory need the token count to be a multiple of 8.
    return (plgpu is not None and not isinstance(k_cache_PSKH, QuantKV) and str(q_TNH.dtype) in MGPU_DTYPES and head_dim % 64 == 0
            and block_size % 64 == 0 and num_tokens % 8 == 0 and sliding_window is None)


def num_prefill_tiles(num_tokens: int, num_seqs: int, min_q_len: int) -> int:
    """Tiles of 2W rows that cover the q rows of every sequence with q_len >= min_q_len (at most
    T / min_q_len of them), each starting up to 7 rows early: sum_b cdiv(q_b + 7, 2W) <= (T + n (2W + 6)) / 2W."""
    tile = 2 * ROWS_PER_WG
    seqs = min(num_seqs, num_tokens // max(min_q_len, 1))
    return max(1, (num_tokens + seqs * (tile + 6)) // tile)


def prefill_tiles(kv_lens_B, cu_q_lens_B1, *, num_tiles: int, min_q_len: int):
    """[6, G] int32: per tile (sequence, first q row (a multiple of 8), first valid row in the tile, end of
    the valid rows (lo == hi: idle), position of the tile's row 0 (negative for rows before the sequence));
    row 5 holds the number of live tiles (they come first), so the kernel skips the idle ones at once."""
    tile = 2 * ROWS_PER_WG
    num_seqs = kv_lens_B.shape[0]
    start_B, stop_B = cu_q_lens_B1[:-1], cu_q_lens_B1[1:]
    aligned_B = start_B - start_B % 8
    tiles_B = jnp.where(stop_B - start_B >= min_q_len, (stop_B - aligned_B + tile - 1) // tile, 0)
    end_B = jnp.cumsum(tiles_B)
    g_G = jnp.arange(num_tiles, dtype=jnp.int32)
    seq_G = jnp.searchsorted(end_B, g_G, side="right").astype(jnp.int32)
    live_G = seq_G < num_seqs
    seq_G = jnp.minimum(seq_G, num_seqs - 1)
    row0_G = aligned_B[seq_G] + (g_G - (end_B[seq_G] - tiles_B[seq_G])) * tile
    lo_G = jnp.clip(start_B[seq_G] - row0_G, 0, tile)
    hi_G = jnp.where(live_G, jnp.clip(stop_B[seq_G] - row0_G, lo_G, tile), lo_G)
    pos0_G = kv_lens_B[seq_G] - (stop_B[seq_G] - row0_G)
    live_G = jnp.broadcast_to(end_B[-1], g_G.shape)
    return jnp.stack([seq_G, row0_G, lo_G, hi_G, pos0_G, live_G]).astype(jnp.int32)
