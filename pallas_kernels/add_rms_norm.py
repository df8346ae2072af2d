"""Residual add fused with RMSNorm: one Pallas (Triton backend) launch per add + norm pair of a decoder.

Why: a batch-1 decode step is launch-bound. Per decoder layer XLA runs a residual-add kernel and a
separate RMSNorm kernel, twice (profile of a Llama-3-8B step on an H200: 64 norm launches, 111 us, and
63 add launches, 106 us, per step). Carrying the residual as vLLM does (`lmjax.models.llama`) turns
every add + norm pair into one call of this op: one launch that reads x and the residual once, writes
the new residual and the normed rows.

Status: opt-in (LMJAX_NORM_IMPL=kernel, see `lmjax.layers.norm`); checked against the reference in
interpret mode on CPU and compiled on an H200 (all tests pass); in the 8B batch-1 decode step it measured
no faster than XLA's two launches (4.657 vs 4.533 ms, 2026-11-23; the tiling below is untuned).

Semantics (those of `add_rms_norm_reference`, which are lmjax's `RMSNorm` after a jnp `x + residual`):
  new_residual = x + residual                                  one rounding to x's dtype
  normed = weight * (f32(new_residual) * rsqrt(mean(f32(new_residual)^2) + eps)).astype(x's dtype)
with the product `weight * normed` in jnp's promoted dtype of the two (x's dtype when they agree).
residual None: no add; new_residual is x itself and the op is a plain RMSNorm (the first layer's input
norm). The kernel reduces in another order than XLA: float32 statistics may differ in the last bits.

Shape letters: T tokens, D hidden. In the kernel R rows of a block (a power of two) and E = D padded to
a power of two; program i normalizes rows i*R .. i*R + R - 1, masked past T and past D.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._validate import require, require_dtype, require_impl, require_rank
from pallas_kernels._pallas_util import (  # the shared Pallas helpers (not via the attention op)
    FLOAT_DTYPES,
    _masked_load,
    _masked_store,
    _next_pow2,
    _on_gpu,
    _triton_compiler_params,
)

MAX_KERNEL_D = 16384  # a whole row lives in registers: past this the kernel would spill badly
_TILE_ELEMS = 4096  # rows per program: as many as fill a tile of this many elements (at least one)


def validate_add_rms_norm(x_TD, residual_TD, weight_D, eps, impl="auto") -> None:
    """Shared by kernel and reference: static shapes, dtypes and scalars; errors name the bad value."""
    require_impl(impl)
    require_rank("x_TD", x_TD, 2, "T, D")
    require_dtype("x_TD", x_TD, FLOAT_DTYPES)
    if residual_TD is not None:
        require(tuple(residual_TD.shape) == tuple(x_TD.shape),
                f"residual_TD.shape={tuple(residual_TD.shape)} must equal x_TD.shape={tuple(x_TD.shape)}")
        require(residual_TD.dtype == x_TD.dtype,
                f"residual_TD.dtype={residual_TD.dtype} must equal x_TD.dtype={x_TD.dtype}")
    require(tuple(weight_D.shape) == (x_TD.shape[1],),
            f"weight_D.shape={tuple(weight_D.shape)} must be ({x_TD.shape[1]},), the hidden size D of x_TD")
    require_dtype("weight_D", weight_D, FLOAT_DTYPES)
    require(isinstance(eps, float) and eps >= 0.0, f"eps={eps!r} must be a Python float >= 0")


# ---------------------------------------------------------------- reference
def add_rms_norm_reference(x_TD, residual_TD, weight_D, eps: float):
    """jnp reference: (normed_TD, new_residual_TD), the exact XLA ops of `x + residual` then RMSNorm."""
    validate_add_rms_norm(x_TD, residual_TD, weight_D, eps)
    s_TD = x_TD if residual_TD is None else x_TD + residual_TD
    s32_TD = s_TD.astype(jnp.float32)
    variance_T1 = jnp.mean(s32_TD * s32_TD, axis=-1, keepdims=True)
    normed_TD = (s32_TD * jax.lax.rsqrt(variance_T1 + eps)).astype(s_TD.dtype)
    return weight_D * normed_TD, s_TD


# ---------------------------------------------------------------- kernel
def _lanes(program, block_rows: int, num_tokens: int, dim: int):
    """(row_R, d_E, d_ok_E, ok_RE): the rows and columns of program `program`'s tile and its mask.
    Masked lanes index one past the end (row T, column D): never touched on the GPU, and interpret
    mode drops their scatter instead of racing a real element."""
    row_R = program * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    d_E = jnp.arange(_next_pow2(dim), dtype=jnp.int32)
    row_ok_R, d_ok_E = row_R < num_tokens, d_E < dim
    row_R, d_E = jnp.where(row_ok_R, row_R, num_tokens), jnp.where(d_ok_E, d_E, dim)
    return row_R, d_E, d_ok_E, row_ok_R[:, None] & d_ok_E[None, :]


def _add_rms_norm_kernel(*refs, eps, block_rows, has_residual):
    """refs: x_TD [T, D], (residual_TD [T, D]), weight_D [D] in; normed_TD [T, D], (new_residual_TD) out."""
    if has_residual:
        x_TD_ref, residual_TD_ref, weight_D_ref, normed_TD_ref, new_residual_TD_ref = refs
    else:
        x_TD_ref, weight_D_ref, normed_TD_ref = refs
    row_R, d_E, d_ok_E, ok_RE = _lanes(pl.program_id(0), block_rows, *x_TD_ref.shape)
    at_RE = (row_R[:, None], d_E[None, :])
    s32_RE = _masked_load(x_TD_ref.at[at_RE], ok_RE, 0.0).astype(jnp.float32)
    if has_residual:
        # Summed in float32, then rounded to the dtype: for bf16/fp16 that double rounding still gives
        # the correctly rounded sum (float32 has >= 2p + 2 bits), i.e. XLA's `x + residual`.
        r32_RE = _masked_load(residual_TD_ref.at[at_RE], ok_RE, 0.0).astype(jnp.float32)
        s_RE = (s32_RE + r32_RE).astype(x_TD_ref.dtype)
        _masked_store(new_residual_TD_ref.at[at_RE], s_RE, ok_RE)
        s32_RE = s_RE.astype(jnp.float32)
    variance_R1 = jnp.sum(s32_RE * s32_RE, axis=1, keepdims=True) / x_TD_ref.shape[1]  # padded lanes hold 0
    normed_RE = (s32_RE * jax.lax.rsqrt(variance_R1 + eps)).astype(x_TD_ref.dtype)
    w_1E = _masked_load(weight_D_ref.at[d_E], d_ok_E, 0.0).astype(jnp.float32)[None, :]
    # Exact in float32 for 16-bit operands, then one rounding: jnp's `weight * normed` in the out dtype.
    out_RE = (w_1E * normed_RE.astype(jnp.float32)).astype(normed_TD_ref.dtype)
    _masked_store(normed_TD_ref.at[at_RE], out_RE, ok_RE)


def _tiling(num_tokens: int, dim: int) -> tuple[int, int]:
    """(rows per program, num_warps): untuned first guess, ~16 elements a thread (Triton's layer-norm
    tutorial), one row per program from D = 4096 on (a decode step has a handful of rows anyway)."""
    width = _next_pow2(dim)
    block_rows = min(max(1, _TILE_ELEMS // width), _next_pow2(num_tokens))
    return block_rows, min(max(block_rows * width // 256, 1), 16)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm_pallas(x_TD, residual_TD, weight_D, *, eps, interpret):
    num_tokens, dim = x_TD.shape
    block_rows, num_warps = _tiling(num_tokens, dim)
    has_residual = residual_TD is not None
    out_dtype = jnp.promote_types(x_TD.dtype, weight_D.dtype)
    out_TD = jax.ShapeDtypeStruct(x_TD.shape, out_dtype)
    kernel = functools.partial(_add_rms_norm_kernel, eps=eps, block_rows=block_rows, has_residual=has_residual)
    outs = pl.pallas_call(
        kernel,
        out_shape=(out_TD, jax.ShapeDtypeStruct(x_TD.shape, x_TD.dtype)) if has_residual else (out_TD,),
        grid=(pl.cdiv(num_tokens, block_rows),),
        # The new residual overwrites the old one's buffer (each program reads its rows before it
        # writes them): no second [T, D] allocation; XLA copies first only if the caller keeps the old.
        input_output_aliases={1: 1} if has_residual else {},
        compiler_params=_triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if has_residual else "rms_norm",
    )(*((x_TD, residual_TD, weight_D) if has_residual else (x_TD, weight_D)))
    return (outs[0], outs[1]) if has_residual else (outs[0], x_TD)


def add_rms_norm_kernel(x_TD, residual_TD, weight_D, eps: float, *, interpret: bool = False):
    """The Pallas kernel with add_rms_norm_reference's arguments and results (one launch)."""
    validate_add_rms_norm(x_TD, residual_TD, weight_D, eps)
    require(x_TD.shape[1] <= MAX_KERNEL_D, f"x_TD.shape={tuple(x_TD.shape)}: the kernel takes D <= {MAX_KERNEL_D}")
    if x_TD.shape[0] == 0:  # no rows, no launch (a grid of 0 programs)
        return add_rms_norm_reference(x_TD, residual_TD, weight_D, eps)
    return _add_rms_norm_pallas(x_TD, residual_TD, weight_D, eps=eps, interpret=interpret)


def add_rms_norm(x_TD, residual_TD, weight_D, eps: float, *, impl: str = "auto", interpret: bool = False):
    """(normed_TD, new_residual_TD) = (RMSNorm(x + residual), x + residual); residual None: no add.

    impl: "auto" -> kernel on GPU (or with interpret=True), reference elsewhere; "kernel" or
    "reference" force one."""
    validate_add_rms_norm(x_TD, residual_TD, weight_D, eps, impl)
    if impl == "reference" or (impl == "auto" and not (interpret or _on_gpu())):
        return add_rms_norm_reference(x_TD, residual_TD, weight_D, eps)
    return add_rms_norm_kernel(x_TD, residual_TD, weight_D, eps, interpret=interpret)
