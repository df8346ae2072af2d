"""A one-row GEMV over an out-major weight w[O, I] (torch's layout), with the decoder's neighbours fused:
an "add residual, then RMSNorm" prologue and a SwiGLU epilogue.

Why: a batch-1 decode step is launch-bound. XLA runs the small GEMMs split-K with a reduction launch and
keeps every norm, residual add and SwiGLU a launch of its own (1B profile, H200, 2026-11-24: ~115 us of a
986 us step in those launches, BENCHMARKS.md session 11). Here program p owns R whole output rows and
reads them in contiguous [R, BK] chunks along I, so no K split and no reduction launch is needed, and
whatever the row needs before or after its dot fits in the same program:

- prologue (`norm_weight_I` given): s = x + residual (rounded to x's dtype, as the XLA add is), then
  normed = weight * (s * rsqrt(mean(s^2) + eps)), with HF's roundings (statistics in float32, the
  normalized row cast back before the weight). Every program sums s^2 itself (a first pass over the
  row, from L2: I elements against R * I of weight); program 0 also writes s out (the new residual).
- epilogue (`swiglu`): w holds [gate; up] rows (2 * O' rows); program p reads gate rows and up rows of
  the same outputs and writes silu(gate) * up, gate and up rounded to x's dtype first as the unfused
  GEMM outputs are.

Products and sums are float32 FMA over [R, BK] tiles (T accumulators: each token reuses the tile); the
output is rounded once. Measured (H200, 2026-11-24, benchmarks/gemv_om_bench.py, BENCHMARKS.md session
12): 1B q/k/v with add + norm 5.6 us where XLA's add, norm and 4-row GEMM take 11.8; o 3.9 vs 9.1; gate/up
with add + norm + SwiGLU 19.3 vs 20.6; down 10.2 vs 10.0. On the 8B shape XLA's GEMMs are faster. Above
MAX_T rows use a dot (XLA): these FMA tiles are 2-2.5x slower at 4 rows.

Shape letters: T tokens, I input, O output rows (of w), P output columns (O, or O / 2 with swiglu),
R rows a program, BK columns a chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas_util import _on_gpu, _triton_compiler_params
from pallas_kernels._validate import is_power_of_two, require
from pallas_kernels.add_rms_norm import add_rms_norm_reference

TUNABLES = ("rows", "block_k", "num_warps", "num_stages")
MAX_T = 2  # the most tokens it takes: float32 FMA tiles, one accumulator a token


def choose_config(I: int, P: int, swiglu: bool, rows=None, block_k=None, num_warps=None, num_stages=3) -> dict:
    """R rows x BK columns a chunk. From `benchmarks/gemv_om_bench.py --sweep` (H200, 2026-11-24; most
    tiles sit within 5-10% of the best): 4 rows in chunks of up to 2048 columns (1B q/k/v 5.6 us, o 3.9,
    down 10.0); with swiglu 32 rows in chunks of 256 (1B gate/up 19.0 us against 21.8 for 4 x 1024: each
    program re-normalizes x, so more rows a program spread that work thinner). 8 warps for tiles of 8192
    elements or more."""
    block_k = block_k or min(256 if swiglu else 2048, I & -I)  # largest power of two dividing I, capped
    rows = rows or min(32 if swiglu else 4, P & -P)
    num_warps = num_warps or (8 if rows * block_k >= 8192 else 4)
    return dict(rows=rows, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def validate(x_TI, w_OI, residual_TI, norm_weight_I, swiglu: bool, config: dict) -> None:
    """Named errors for shapes and tiles the kernel cannot take."""
    require(x_TI.ndim == 2 and w_OI.ndim == 2, f"gemv_om wants x [T, I] and w [O, I], got {x_TI.shape} and "
                                               f"{w_OI.shape}")
    T, I = x_TI.shape
    require(w_OI.shape[1] == I, f"gemv_om: w's input dim {w_OI.shape[1]} != x's {I}")
    require(1 <= T <= MAX_T, f"gemv_om takes 1..{MAX_T} tokens, got T={T} (use a dot above)")
    require(not swiglu or w_OI.shape[0] % 2 == 0, f"gemv_om swiglu wants [gate; up] rows, got O={w_OI.shape[0]}")
    require(residual_TI is None or norm_weight_I is not None, "gemv_om: a residual comes with norm_weight_I")
    for name, a, shape in (("residual_TI", residual_TI, (T, I)), ("norm_weight_I", norm_weight_I, (I,))):
        require(a is None or a.shape == shape, f"gemv_om: {name} shape {getattr(a, 'shape', None)} != {shape}")
    unknown = set(config) - set(TUNABLES)
    require(not unknown, f"gemv_om: unknown config keys {sorted(unknown)}; tunables: {TUNABLES}")
    P = w_OI.shape[0] // (2 if swiglu else 1)
    c = choose_config(I, P, swiglu, **config)
    for key in ("rows", "block_k"):
        require(is_power_of_two(c[key]), f"gemv_om: {key}={c[key]} must be a power of two")
    require(P % c["rows"] == 0, f"gemv_om: rows={c['rows']} must divide the {P} outputs")
    require(I % c["block_k"] == 0, f"gemv_om: block_k={c['block_k']} must divide I={I}")


def _normed_chunk(x_ref, res_ref, g_ref, t, cols, r, dtype):
    """weight * (s * r) over one chunk, s = x + residual, in HF's roundings (see the module docstring)."""
    s = _sum_chunk(x_ref, res_ref, t, cols, dtype)
    normed = (s.astype(jnp.float32) * r).astype(dtype).astype(jnp.float32)
    return (g_ref[cols].astype(jnp.float32) * normed).astype(dtype).astype(jnp.float32)


def _sum_chunk(x_ref, res_ref, t, cols, dtype):
    x = x_ref[t, cols]
    return x if res_ref is None else (x.astype(jnp.float32) + res_ref[t, cols].astype(jnp.float32)).astype(dtype)


def norm_rstd_T(x_ref, res_ref, s_ref, *, p, T, I, BK, eps):
    """The prologue's first pass: 1 / rms of s = x + residual per token, float32 (a list of T scalars).
    Program 0 also stores s into s_ref (the new residual stream)."""
    dtype = x_ref.dtype

    def squares(i, acc_T):
        cols = pl.ds(pl.multiple_of(i * BK, BK), BK)
        out = []
        for t in range(T):
            s = _sum_chunk(x_ref, res_ref, t, cols, dtype)

            @pl.when(p == 0)
            def _():
                s_ref[t, cols] = s.astype(s_ref.dtype)

            s32 = s.astype(jnp.float32)
            out.append(acc_T[t] + s32 * s32)
        return tuple(out)

    ss_T = jax.lax.fori_loop(0, I // BK, squares, tuple(jnp.zeros((BK,), jnp.float32) for _ in range(T)))
    return [jax.lax.rsqrt(jnp.sum(ss) / I + eps) for ss in ss_T]


def dot_row_blocks(x_ref, res_ref, g_ref, w_ref, row_blocks, r_T, *, T, I, BK):
    """float32 [R, BK] accumulators of w[rows] times each token's x (normed when g_ref is given: r_T
    from `norm_rstd_T`), T of them per row block, block-major; the caller sums them over BK."""
    dtype = x_ref.dtype

    def body(i, acc):
        cols = pl.ds(pl.multiple_of(i * BK, BK), BK)
        x_T = [(_normed_chunk(x_ref, res_ref, g_ref, t, cols, r_T[t], dtype) if g_ref is not None
                else x_ref[t, cols].astype(jnp.float32)) for t in range(T)]
        out = []
        for b, rows in enumerate(row_blocks):
            w = w_ref[rows, cols].astype(jnp.float32)  # [R, BK]
            out += [acc[b * T + t] + w * x_T[t][None, :] for t in range(T)]
        return tuple(out)

    R = row_blocks[0].size
    zeros = tuple(jnp.zeros((R, BK), jnp.float32) for _ in range(T * len(row_blocks)))
    return jax.lax.fori_loop(0, I // BK, body, zeros)


def _kernel(*refs, T, I, P, R, BK, eps, norm, has_residual, swiglu):
    it = iter(refs)
    x_ref = next(it)
    res_ref = next(it) if has_residual else None
    g_ref = next(it) if norm else None
    w_ref, o_ref = next(it), next(it)
    s_ref = next(it) if norm else None
    dtype, p = x_ref.dtype, pl.program_id(0)
    r_T = norm_rstd_T(x_ref, res_ref, s_ref, p=p, T=T, I=I, BK=BK, eps=eps) if norm else [None] * T
    row_blocks = [pl.ds(p * R, R)] + ([pl.ds(P + p * R, R)] if swiglu else [])
    acc = dot_row_blocks(x_ref, res_ref, g_ref, w_ref, row_blocks, r_T, T=T, I=I, BK=BK)
    for t in range(T):
        y = jnp.sum(acc[t], axis=1).astype(dtype)
        if swiglu:  # gate and up rounded as the GEMM outputs are, then one rounding of silu(gate) * up
            g = y.astype(jnp.float32)
            u = jnp.sum(acc[T + t], axis=1).astype(dtype).astype(jnp.float32)
            y = (g / (1.0 + jnp.exp(-g)) * u).astype(dtype)
        o_ref[t, pl.ds(p * R, R)] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "interpret", "config"))
def _gemv_om_pallas(x_TI, w_OI, residual_TI, norm_weight_I, *, eps, swiglu, interpret, config):
    T, I = x_TI.shape
    P = w_OI.shape[0] // (2 if swiglu else 1)
    c = choose_config(I, P, swiglu, **dict(config))
    norm = norm_weight_I is not None
    args = [x_TI] + ([residual_TI] if residual_TI is not None else []) + ([norm_weight_I] if norm else []) + [w_OI]
    out_shape = [jax.ShapeDtypeStruct((T, P), x_TI.dtype)] + ([jax.ShapeDtypeStruct((T, I), x_TI.dtype)] if norm else [])
    kernel = functools.partial(_kernel, T=T, I=I, P=P, R=c["rows"], BK=c["block_k"], eps=eps, norm=norm,
                               has_residual=residual_TI is not None, swiglu=swiglu)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(P // c["rows"],), interpret=interpret,
                          compiler_params=_triton_compiler_params(c["num_warps"], c["num_stages"]))(*args)
    return outs[0], (outs[1] if norm else None)


def gemv_om(x_TI, w_OI, *, residual_TI=None, norm_weight_I=None, eps: float = 1e-6, swiglu: bool = False,
            interpret: bool | None = None, config: dict | None = None):
    """(y_TP, s_TI): y = (normed x) @ w.T (swiglu: silu(gate) * up of its two halves); s = x + residual
    when `norm_weight_I` is given (the new residual stream), else None. interpret: default off the GPU."""
    config = dict(config or {})
    validate(x_TI, w_OI, residual_TI, norm_weight_I, swiglu, config)
    interpret = (not _on_gpu()) if interpret is None else interpret
    return _gemv_om_pallas(x_TI, w_OI, residual_TI, norm_weight_I, eps=float(eps), swiglu=swiglu,
                           interpret=interpret, config=tuple(sorted(config.items())))


def gemv_om_reference(x_TI, w_OI, *, residual_TI=None, norm_weight_I=None, eps: float = 1e-6,
                      swiglu: bool = False):
    """The unfused computation in jnp, the roundings of lmjax's RMSNorm, GEMM and SwiGLU."""
    s_TI = None
    if norm_weight_I is not None:
        x_TI, s_TI = add_rms_norm_reference(x_TI, residual_TI, norm_weight_I, eps)
    y_TO = jax.lax.dot_general(x_TI, w_OI, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST)  # float32 as float32 (not tf32) on a GPU
    y_TO = y_TO.astype(x_TI.dtype)
    if swiglu:
        gate, up = jnp.split(y_TO, 2, axis=-1)
        y_TO = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x_TI.dtype)
    return y_TO, s_TI
