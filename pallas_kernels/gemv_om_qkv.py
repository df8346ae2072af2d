"""The merged q/k/v projection of a decode step in one launch: add + RMSNorm, the one-row GEMV over
the out-major weight [N + 2K heads x H, I], RoPE of q and k, and the K/V write into the paged cache.

Why: at batch 1 a decode step is a chain of small launches, each paying its ramp and tail (1B, H200:
the RoPE + KV-write kernel after the q/k/v GEMV costs ~2 us a layer of ~55). gemv_om's programs own
whole output rows, so the rows RoPE pairs (channel c and c + H/2 of a head, rotate-half) can be given to
one program: program p takes head h = p // (H / 2R) and channels j*R .. j*R + R - 1 of both halves (two
row blocks of R rows, as gemv_om's SwiGLU takes gate and up rows), rotates them in float32 with cos / sin
rounded to x's dtype as HF does (rope_kv_write's numerics), and stores q into a new [T, N, H] array,
k and v into cache slot slot_mapping[t] (caches updated in place, slots outside the cache dropped).
v heads take the same two blocks unrotated. The prologue and the dot loop are gemv_om's.
Measured (H200, 2026-11-24, benchmarks/gemv_om_bench.py --qkv-rope, 1B heads, CUPTI): 6.33 us a call
against 7.42 for gemv_om + rope_kv_write_qkv at T = 1 (8.51 vs 9.76 at T = 2); the 1B batch-1 decode
step 0.935 / 0.948 ms with it vs 0.941 / 0.955 without (LMJAX_QKV_ROPE_FUSION=off), BENCHMARKS.md
session 13.

Scope: full rotary (inv_freq has H / 2 entries), one cache head per KV head (no tensor-parallel
repeats), float caches; T <= gemv_om.MAX_T. Callers fall back to gemv_om + rope_kv_write otherwise.

Shape letters: T tokens, I input, X = N + 2K merged heads, H head dim, F = H / 2 frequencies,
Z flat cache slots, R rows of each half a program, BK columns a chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas_util import _masked_store, _on_gpu, _triton_compiler_params
from pallas_kernels._validate import is_power_of_two, require
from pallas_kernels.gemv_om import MAX_T, dot_row_blocks, gemv_om_reference, norm_rstd_T
from pallas_kernels.rope_kv_write import rope_kv_write_reference, split_qkv

TUNABLES = ("rows", "block_k", "num_warps", "num_stages")


def choose_config(I: int, H: int, T: int = 1, rows=None, block_k=None, num_warps=4, num_stages=3) -> dict:
    """R rows of each half x BK columns, 4 warps. From `benchmarks/gemv_om_bench.py --qkv-rope --sweep`
    (H200, 2026-11-24, 1B heads; us a call, against 7.42 / 9.76 for gemv_om + rope_kv_write_qkv):
    T = 1: 2 + 2 rows in chunks of 2048 columns, 6.35 us (8 warps 6.88); T = 2: 4 + 4 rows in chunks of
    512, 8.56 us (2 + 2 rows x 2048: 11.4)."""
    block_k = block_k or min(2048 if T == 1 else 512, I & -I)
    rows = rows or min(2 if T == 1 else 4, H // 2)
    return dict(rows=rows, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def validate(x_TI, w_XI, residual_TI, norm_weight_I, num_kv_heads, head_dim, positions_T, inv_freq_TF,
             k_cache_PSKH, v_cache_PSKH, slot_mapping_T, config: dict) -> None:
    """Named errors for what the fused kernel cannot take."""
    require(x_TI.ndim == 2 and w_XI.ndim == 2, f"gemv_om_qkv wants x [T, I] and w [X*H, I], got {x_TI.shape} "
                                               f"and {w_XI.shape}")
    T, I = x_TI.shape
    require(1 <= T <= MAX_T, f"gemv_om_qkv takes 1..{MAX_T} tokens, got T={T}")
    require(w_XI.shape[1] == I, f"gemv_om_qkv: w's input dim {w_XI.shape[1]} != x's {I}")
    require(head_dim % 2 == 0 and w_XI.shape[0] % head_dim == 0,
            f"gemv_om_qkv: w's {w_XI.shape[0]} rows are not whole heads of {head_dim=}")
    heads = w_XI.shape[0] // head_dim
    require(heads > 2 * num_kv_heads, f"gemv_om_qkv: {heads} heads cannot hold N > 0 q heads and 2 x {num_kv_heads} kv")
    require(tuple(inv_freq_TF.shape) == (T, head_dim // 2),
            f"gemv_om_qkv wants full rotary: inv_freq_TF.shape={tuple(inv_freq_TF.shape)} != {(T, head_dim // 2)}")
    require(tuple(positions_T.shape) == (T,) and tuple(slot_mapping_T.shape) == (T,),
            f"gemv_om_qkv: positions {tuple(positions_T.shape)} and slots {tuple(slot_mapping_T.shape)} != ({T},)")
    require(k_cache_PSKH.ndim == 4 and tuple(k_cache_PSKH.shape[2:]) == (num_kv_heads, head_dim)
            and v_cache_PSKH.shape == k_cache_PSKH.shape and v_cache_PSKH.dtype == k_cache_PSKH.dtype,
            f"gemv_om_qkv wants float caches [P, S, {num_kv_heads}, {head_dim}], got {k_cache_PSKH.shape} / "
            f"{v_cache_PSKH.shape}")
    require(norm_weight_I is not None and tuple(norm_weight_I.shape) == (I,),
            f"gemv_om_qkv wants norm_weight_I of shape ({I},)")
    require(residual_TI is None or tuple(residual_TI.shape) == (T, I),
            f"gemv_om_qkv: residual_TI shape {getattr(residual_TI, 'shape', None)} != {(T, I)}")
    unknown = set(config) - set(TUNABLES)
    require(not unknown, f"gemv_om_qkv: unknown config keys {sorted(unknown)}; tunables: {TUNABLES}")
    c = choose_config(I, head_dim, T, **config)
    for key in ("rows", "block_k"):
        require(is_power_of_two(c[key]), f"gemv_om_qkv: {key}={c[key]} must be a power of two")
    require((head_dim // 2) % c["rows"] == 0, f"gemv_om_qkv: rows={c['rows']} must divide H/2={head_dim // 2}")
    require(I % c["block_k"] == 0, f"gemv_om_qkv: block_k={c['block_k']} must divide I={I}")


def _store_slot(cache_ref, slot, head, cols, val, num_slots):
    """cache[slot, head, cols] = val, dropped when the slot lies outside the cache."""
    ok = jnp.full(val.shape, True) & (slot >= 0) & (slot < num_slots)
    _masked_store(cache_ref.at[jnp.clip(slot, 0, num_slots - 1), head, cols], val.astype(cache_ref.dtype), ok)


def _kernel(pos_ref, inv_freq_ref, slots_ref, x_ref, *refs, T, I, N, K, H, R, BK, eps, attention_scaling,
            has_residual):
    it = iter(refs)
    res_ref = next(it) if has_residual else None
    g_ref, w_ref = next(it), next(it)
    next(it), next(it)  # the caches' inputs: the same buffers as the outputs below
    q_ref, kc_ref, vc_ref, s_ref = next(it), next(it), next(it), next(it)
    dtype, p, F = x_ref.dtype, pl.program_id(0), H // 2
    head, j = p // (F // R), p % (F // R)
    r_T = norm_rstd_T(x_ref, res_ref, s_ref, p=p, T=T, I=I, BK=BK, eps=eps)
    rows_a, rows_b = pl.ds(head * H + j * R, R), pl.ds(head * H + F + j * R, R)
    acc = dot_row_blocks(x_ref, res_ref, g_ref, w_ref, [rows_a, rows_b], r_T, T=T, I=I, BK=BK)
    cols_a, cols_b = pl.ds(j * R, R), pl.ds(F + j * R, R)
    num_slots = kc_ref.shape[0]
    for t in range(T):
        a = jnp.sum(acc[t], axis=1).astype(dtype).astype(jnp.float32)  # the GEMM output's rounding
        b = jnp.sum(acc[T + t], axis=1).astype(dtype).astype(jnp.float32)
        angle = pos_ref[t].astype(jnp.float32) * inv_freq_ref[t, cols_a]
        cos = (jnp.cos(angle) * attention_scaling).astype(dtype).astype(jnp.float32)
        sin = (jnp.sin(angle) * attention_scaling).astype(dtype).astype(jnp.float32)
        ra, rb = a * cos - b * sin, b * cos + a * sin
        slot = slots_ref[t]

        @pl.when(head < N)
        def _q():
            q_ref[t, head, cols_a] = ra.astype(q_ref.dtype)
            q_ref[t, head, cols_b] = rb.astype(q_ref.dtype)

        @pl.when((head >= N) & (head < N + K))
        def _k():
            _store_slot(kc_ref, slot, head - N, cols_a, ra, num_slots)
            _store_slot(kc_ref, slot, head - N, cols_b, rb, num_slots)

        @pl.when(head >= N + K)
        def _v():
            _store_slot(vc_ref, slot, head - N - K, cols_a, a, num_slots)
            _store_slot(vc_ref, slot, head - N - K, cols_b, b, num_slots)


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "head_dim", "eps", "attention_scaling", "interpret",
                                             "config"))
def _pallas(x_TI, w_XI, residual_TI, norm_weight_I, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH,
            slot_mapping_T, *, num_kv_heads, head_dim, eps, attention_scaling, interpret, config):
    T, I = x_TI.shape
    H, K = head_dim, num_kv_heads
    N = w_XI.shape[0] // H - 2 * K
    c = choose_config(I, H, T, **dict(config))
    P, S = k_cache_PSKH.shape[:2]
    has_residual = residual_TI is not None
    args = [positions_T, inv_freq_TF.astype(jnp.float32), slot_mapping_T, x_TI] + \
        ([residual_TI] if has_residual else []) + [norm_weight_I, w_XI, k_cache_PSKH.reshape(P * S, K, H),
                                                   v_cache_PSKH.reshape(P * S, K, H)]
    cache = jax.ShapeDtypeStruct((P * S, K, H), k_cache_PSKH.dtype)
    out_shape = [jax.ShapeDtypeStruct((T, N, H), x_TI.dtype), cache, cache, jax.ShapeDtypeStruct((T, I), x_TI.dtype)]
    kernel = functools.partial(_kernel, T=T, I=I, N=N, K=K, H=H, R=c["rows"], BK=c["block_k"], eps=eps,
                               attention_scaling=attention_scaling, has_residual=has_residual)
    first_cache = len(args) - 2
    q_TNH, k_ZKH, v_ZKH, s_TI = pl.pallas_call(
        kernel, out_shape=out_shape, grid=((N + 2 * K) * (H // 2 // c["rows"]),),
        input_output_aliases={first_cache: 1, first_cache + 1: 2}, interpret=interpret, name="gemv_om_qkv",
        compiler_params=_triton_compiler_params(c["num_warps"], c["num_stages"]))(*args)
    return q_TNH, k_ZKH.reshape(P, S, K, H), v_ZKH.reshape(P, S, K, H), s_TI


def gemv_om_qkv(x_TI, w_XI, *, residual_TI, norm_weight_I, eps: float, num_kv_heads: int, head_dim: int,
                positions_T, inv_freq_TF, attention_scaling: float, k_cache_PSKH, v_cache_PSKH, slot_mapping_T,
                interpret: bool | None = None, config: dict | None = None):
    """(q_TNH, k_cache, v_cache, s_TI): norm(x + residual) @ w.T split into q / k / v heads, q and k
    rotated, k and v written at their slots; s = x + residual. Donate the caches to the enclosing jit
    so the write is in place. interpret: default off the GPU."""
    config = dict(config or {})
    validate(x_TI, w_XI, residual_TI, norm_weight_I, num_kv_heads, head_dim, positions_T, inv_freq_TF,
             k_cache_PSKH, v_cache_PSKH, slot_mapping_T, config)
    interpret = (not _on_gpu()) if interpret is None else interpret
    return _pallas(x_TI, w_XI, residual_TI, norm_weight_I, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH,
                   slot_mapping_T, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=float(eps),
                   attention_scaling=float(attention_scaling), interpret=interpret,
                   config=tuple(sorted(config.items())))


def gemv_om_qkv_reference(x_TI, w_XI, *, residual_TI, norm_weight_I, eps: float, num_kv_heads: int,
                          head_dim: int, positions_T, inv_freq_TF, attention_scaling: float, k_cache_PSKH,
                          v_cache_PSKH, slot_mapping_T):
    """The unfused computation: gemv_om_reference, then rope_kv_write_reference."""
    qkv_TX, s_TI = gemv_om_reference(x_TI, w_XI, residual_TI=residual_TI, norm_weight_I=norm_weight_I, eps=eps)
    q_TNH, k_TKH, v_TKH = split_qkv(qkv_TX.reshape(x_TI.shape[0], -1, head_dim), num_kv_heads)
    q_TNH, k_cache, v_cache = rope_kv_write_reference(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF,
                                                      attention_scaling, k_cache_PSKH, v_cache_PSKH, slot_mapping_T)
    return q_TNH, k_cache, v_cache, s_TI
