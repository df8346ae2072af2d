"""Pallas kernel for rotary embeddings (HF rotate-half / NeoX layout), q and k in one launch.

Shape letters: T tokens, N query heads, K kv heads, H head dim, F = rotary_dim // 2
frequencies; in the kernel Q = tokens of a tile, E = heads padded to a power of two,
D = F padded to a power of two.

Same arguments and numerics as `pallas_kernels.rope.apply_rope_reference` (the math
and the shared validator live there): angles = position * inv_freq in float32, cos
and sin scaled by `attention_scaling` and rounded to x's dtype as HF does, then
  out[:F]  = x[:F] * cos - x[F:2F] * sin
  out[F:2F] = x[F:2F] * cos + x[:F] * sin
and dims 2F.. pass through. The outputs alias the inputs, so only rotary dims are
written. cos/sin are computed once per (token, frequency) and shared by every head
of q and k.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._validate import require, require_dtype, require_impl
from pallas_kernels._pallas_util import (  # the shared Pallas helpers (not via the attention op)
    _masked_load,
    _masked_store,
    _next_pow2,
    _on_gpu,
    _triton_compiler_params,
)
from pallas_kernels.rope import apply_rope_reference, validate_rope_args

_ELEMENTS_PER_TILE = 8192  # elements of one tensor's rotary half a program handles


def _validate(tensors, positions_T, inv_freq_TF, attention_scaling, impl="auto"):
    for x in tensors:
        validate_rope_args(x, positions_T, inv_freq_TF)
        require_dtype("x", x, ("float32", "bfloat16", "float16"))
        require(x.shape[2] == tensors[0].shape[2],
                f"head_dim={x.shape[2]} must match head_dim={tensors[0].shape[2]} of q")
    require_dtype("positions_T", positions_T, ("int32",))
    require_dtype("inv_freq_TF", inv_freq_TF, ("float32",))
    require(isinstance(attention_scaling, (int, float)),
            f"attention_scaling={attention_scaling!r} must be a Python float")
    require_impl(impl)


def _rope_kernel(
    positions_T_ref,  # [T] int32
    inv_freq_TF_ref,  # [T, F] float32
    *refs,            # inputs x_i [T, heads_i, H] (aliased by the outputs), then outputs
    num_tensors, block_t, attention_scaling,
):
    x_refs, o_refs = refs[:num_tensors], refs[num_tensors:]
    num_tokens, half = inv_freq_TF_ref.shape
    t_Q = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    t_ok_Q = t_Q < num_tokens
    f_D = jnp.arange(_next_pow2(half), dtype=jnp.int32)
    f_ok_D = f_D < half
    ok_QD = t_ok_Q[:, None] & f_ok_D[None, :]
    # Masked lanes index out of bounds: never read on the GPU, dropped by the
    # interpret-mode scatter.
    t_Q = jnp.where(t_ok_Q, t_Q, num_tokens)
    f_D = jnp.where(f_ok_D, f_D, x_refs[0].shape[2])
    pos_Q = _masked_load(positions_T_ref.at[t_Q], t_ok_Q, 0).astype(jnp.float32)
    inv_QD = _masked_load(inv_freq_TF_ref.at[t_Q[:, None], f_D[None, :]], ok_QD, 0.0)
    angle_QD = pos_Q[:, None] * inv_QD
    cos_Q1D = (jnp.cos(angle_QD) * attention_scaling)[:, None, :]
    sin_Q1D = (jnp.sin(angle_QD) * attention_scaling)[:, None, :]
    for x_ref, o_ref in zip(x_refs, o_refs):
        dtype, heads = x_ref.dtype, x_ref.shape[1]
        # HF rounds cos/sin to x's dtype before multiplying.
        cos, sin = cos_Q1D.astype(dtype).astype(jnp.float32), sin_Q1D.astype(dtype).astype(jnp.float32)
        e_E = jnp.arange(_next_pow2(heads), dtype=jnp.int32)
        e_ok_E = e_E < heads
        e_E = jnp.where(e_ok_E, e_E, heads)
        ok_QED = ok_QD[:, None, :] & e_ok_E[None, :, None]
        lo = (t_Q[:, None, None], e_E[None, :, None], f_D[None, None, :])
        hi = (lo[0], lo[1], lo[2] + half)
        x1 = _masked_load(x_ref.at[lo], ok_QED, 0.0).astype(jnp.float32)
        x2 = _masked_load(x_ref.at[hi], ok_QED, 0.0).astype(jnp.float32)
        _masked_store(o_ref.at[lo], (x1 * cos - x2 * sin).astype(dtype), ok_QED)
        _masked_store(o_ref.at[hi], (x2 * cos + x1 * sin).astype(dtype), ok_QED)


@functools.partial(jax.jit, static_argnames=("attention_scaling", "interpret"))
def _rope_pallas(tensors, positions_T, inv_freq_TF, *, attention_scaling, interpret):
    num_tokens, half = inv_freq_TF.shape
    widest = max(_next_pow2(x.shape[1]) for x in tensors) * _next_pow2(half)
    block_t = max(1, min(_next_pow2(num_tokens), _ELEMENTS_PER_TILE // widest))
    num_tensors = len(tensors)
    kernel = functools.partial(_rope_kernel, num_tensors=num_tensors, block_t=block_t,
                               attention_scaling=float(attention_scaling))
    return pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in tensors),
        grid=(pl.cdiv(num_tokens, block_t),),
        input_output_aliases={2 + i: i for i in range(num_tensors)},
        compiler_params=_triton_compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope",
    )(positions_T, inv_freq_TF, *tensors)


def apply_rope_kernel(x_TNH, positions_T, inv_freq_TF, attention_scaling: float = 1.0, *,
                      interpret: bool = False):
    """The Pallas kernel with apply_rope_reference's arguments, for one tensor."""
    _validate((x_TNH,), positions_T, inv_freq_TF, attention_scaling)
    (out_TNH,) = _rope_pallas((x_TNH,), positions_T, inv_freq_TF,
                              attention_scaling=attention_scaling, interpret=interpret)
    return out_TNH


def apply_rope_qk(q_TNH, k_TKH, positions_T, inv_freq_TF, attention_scaling: float = 1.0, *,
                  impl: str = "auto", interpret: bool = False):
    """Rotate q and k (same tokens, positions and frequencies) in one launch.

    impl: "auto" -> kernel on GPU (or with interpret=True), reference elsewhere.
    """
    _validate((q_TNH, k_TKH), positions_T, inv_freq_TF, attention_scaling, impl)
    if impl == "reference" or (impl == "auto" and not (interpret or _on_gpu())):
        return (apply_rope_reference(q_TNH, positions_T, inv_freq_TF, attention_scaling),
                apply_rope_reference(k_TKH, positions_T, inv_freq_TF, attention_scaling))
    return _rope_pallas((q_TNH, k_TKH), positions_T, inv_freq_TF,
                        attention_scaling=attention_scaling, interpret=interpret)
