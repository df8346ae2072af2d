"""RoPE of q and k fused with the paged KV-cache write: one Pallas (Triton backend) launch per layer.

Why: a batch-1 decode step is launch-bound (~2-3 us a launch). Unfused, each layer runs a RoPE fusion
for q, a scatter fusion for K (with its RoPE) and one for V before attention; this op does all of it
in one kernel.

Status (H200, 2026-11-23): 3.9 us vs 6.3 us for the XLA path on 8B heads at one token, correct on
random inputs (rel. err 2.2e-3 in bf16, the reference's rounding), but no faster inside the decode
step, and two tests fail on the GPU (run with JAX_PLATFORMS=cuda): several tokens writing the same
slot (the engine's padding rows, all aimed at the never-read sink slot 0) corrupt another token's slot
(test_repeated_slot_with_different_rows_holds_one_of_them: row 2's own slot is wrong). Inside the step
XLA also copies q, k and v out of its merged projection GEMM for this custom call (3 slice fusions, ~120 us
a step on 8B), which cancels the gain; taking one merged qkv projection would avoid that (BENCHMARKS.md).
Until both are fixed the engine takes it only when asked (LMJAX_KV_WRITE_IMPL=kernel); the CPU tests
(interpret mode) pass.

Shape letters: T tokens, N query heads, K kv heads of k/v, C heads the cache stores (C = r * K: under
tensor parallelism the cache may repeat each kv head r times, cache head c holding kv head c // r),
H head dim, F = rotary_dim // 2 frequencies, P cache pages, S slots per page, Z = P * S flat slots.
In the kernel E = a head count padded to a power of two, D = H padded to a power of two.

Data flow: program t (one per token) computes cos/sin of positions[t] * inv_freq[t] once per
dimension (float32, scaled by `attention_scaling`, rounded to the tensor's dtype as HF does), rotates
every head of q[t] into a new q, rotates k[t] and stores it with v[t] at flat slot slot_mapping[t] of
the caches. The caches are updated in place (`input_output_aliases`): slots no token names keep their
contents bit for bit. Numerics and argument checks match `rope_kv_write_reference` (= HF rotate-half
RoPE of pallas_kernels.rope, then the scatter of lmjax's `write_kv`).

Repeated slots: two tokens naming one slot both write it; which one lands is unspecified (so in the
reference, XLA's scatter), element by element in the kernel. lmjax's engine repeats only the padding
sink (slot 0 of block 0, which no sequence reads), so its result equals the reference's wherever it
is ever read; see `tests/pallas_kernels/test_rope_kv_write.py`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._validate import require, require_dtype, require_rank
from pallas_kernels.ragged_paged_attention import (
    FLOAT_DTYPES,
    _masked_load,
    _masked_store,
    _next_pow2,
    _on_gpu,
    _triton_compiler_params,
)
from pallas_kernels.rope import apply_rope_reference
from pallas_kernels.rope_kernel import _validate as _validate_rope


def validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T, impl="auto") -> None:
    """Shared by kernel and reference: static shapes, dtypes and scalars; errors name the bad value."""
    _validate_rope((q_TNH, k_TKH), positions_T, inv_freq_TF, attention_scaling, impl)
    require(tuple(v_TKH.shape) == tuple(k_TKH.shape),
            f"v_TKH.shape={tuple(v_TKH.shape)} must equal k_TKH.shape={tuple(k_TKH.shape)}")
    require_dtype("v_TKH", v_TKH, FLOAT_DTYPES)
    require_rank("k_cache_PSKH", k_cache_PSKH, 4, "P, S, K, H")
    require(tuple(v_cache_PSKH.shape) == tuple(k_cache_PSKH.shape),
            f"v_cache_PSKH.shape={tuple(v_cache_PSKH.shape)} must equal "
            f"k_cache_PSKH.shape={tuple(k_cache_PSKH.shape)}")
    require_dtype("k_cache_PSKH", k_cache_PSKH, FLOAT_DTYPES)
    require(v_cache_PSKH.dtype == k_cache_PSKH.dtype,
            f"v_cache_PSKH.dtype={v_cache_PSKH.dtype} must equal k_cache_PSKH.dtype={k_cache_PSKH.dtype}")
    num_tokens, num_kv_heads, head_dim = k_TKH.shape
    cache_heads, cache_head_dim = k_cache_PSKH.shape[2:]
    require(cache_head_dim == head_dim,
            f"k_cache_PSKH.shape={tuple(k_cache_PSKH.shape)}: head dim must be {head_dim=} of k_TKH")
    require(cache_heads % num_kv_heads == 0,
            f"{cache_heads=} of k_cache_PSKH must be a multiple of {num_kv_heads=} of k_TKH")
    require(tuple(slot_mapping_T.shape) == (num_tokens,),
            f"slot_mapping_T.shape={tuple(slot_mapping_T.shape)} must be ({num_tokens},), one slot per token")
    require_dtype("slot_mapping_T", slot_mapping_T, ("int32",))


# ---------------------------------------------------------------- reference
def scatter_kv_reference(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T):
    """k/v of each token into flat slot slot_mapping_T[t] (= page * S + s), cast to the cache dtype,
    each kv head repeated to fill the cache's heads. In place when the caches are donated."""
    P, S, C, H = k_cache_PSKH.shape
    if C != k_TKH.shape[1]:  # the cache repeats each kv head C / K times
        repeats = C // k_TKH.shape[1]
        k_TKH, v_TKH = jnp.repeat(k_TKH, repeats, axis=1), jnp.repeat(v_TKH, repeats, axis=1)
    k_ZCH = k_cache_PSKH.reshape(P * S, C, H).at[slot_mapping_T].set(k_TKH.astype(k_cache_PSKH.dtype))
    v_ZCH = v_cache_PSKH.reshape(P * S, C, H).at[slot_mapping_T].set(v_TKH.astype(v_cache_PSKH.dtype))
    return k_ZCH.reshape(P, S, C, H), v_ZCH.reshape(P, S, C, H)


def rope_kv_write_reference(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                            k_cache_PSKH, v_cache_PSKH, slot_mapping_T):
    """jnp reference: (rotated q_TNH, k_cache_PSKH, v_cache_PSKH) with rotated k and v written."""
    validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T)
    q_TNH = apply_rope_reference(q_TNH, positions_T, inv_freq_TF, attention_scaling)
    k_TKH = apply_rope_reference(k_TKH, positions_T, inv_freq_TF, attention_scaling)
    return (q_TNH, *scatter_kv_reference(k_cache_PSKH, v_cache_PSKH, k_TKH, v_TKH, slot_mapping_T))


# ---------------------------------------------------------------- kernel
def _rope_tables_D(position, inv_freq_TF_ref, t, head_dim, attention_scaling):
    """Per-dimension float32 cos, signed sin, partner index and rotary mask of token t.

    Rotate-half: out[h] = x[h] * cos[h] + x[partner[h]] * signed_sin[h], partner[h] = h + F (sign -)
    for h < F, h - F (sign +) for F <= h < 2F; dims from 2F on pass through. Padded lanes (h >= H)
    index out of bounds: masked, never read on the GPU, dropped by the interpret-mode scatter.
    """
    half = inv_freq_TF_ref.shape[1]
    h_D = jnp.arange(_next_pow2(head_dim), dtype=jnp.int32)
    rot_D = h_D < 2 * half
    first_D = h_D < half
    f_D = jnp.where(first_D, h_D, jnp.where(rot_D, h_D - half, 0))
    inv_D = _masked_load(inv_freq_TF_ref.at[t, f_D], rot_D, 0.0)
    angle_D = position.astype(jnp.float32) * inv_D
    cos_D = jnp.cos(angle_D) * attention_scaling
    sin_D = jnp.sin(angle_D) * attention_scaling
    signed_sin_D = jnp.where(first_D, -sin_D, sin_D)
    partner_D = jnp.where(first_D, h_D + half, jnp.where(rot_D, h_D - half, h_D))
    h_D = jnp.where(h_D < head_dim, h_D, head_dim)
    partner_D = jnp.where(h_D < head_dim, partner_D, head_dim)
    return h_D, partner_D, rot_D, cos_D, signed_sin_D


def _head_lanes_E(heads: int, stride: int = 1):
    """Lane e of a [E, D] tile reads head e // stride; padded lanes point out of bounds, masked off."""
    e_E = jnp.arange(_next_pow2(heads), dtype=jnp.int32)
    ok_E = e_E < heads
    return jnp.where(ok_E, e_E, heads), jnp.where(ok_E, e_E // stride, heads), ok_E


def _load_heads(x_ref, t, src_E, h_D, ok_ED):
    return _masked_load(x_ref.at[t, src_E[:, None], h_D[None, :]], ok_ED, 0.0).astype(jnp.float32)


def _rotate(x_ref, t, src_E, ok_ED, tables):
    """[E, D] float32 rotated heads src_E of token t (math in float32; cos/sin rounded like HF)."""
    h_D, partner_D, rot_D, cos_D, signed_sin_D = tables
    dtype = x_ref.dtype
    cos_1D = cos_D.astype(dtype).astype(jnp.float32)[None, :]
    sin_1D = signed_sin_D.astype(dtype).astype(jnp.float32)[None, :]
    x_ED = _load_heads(x_ref, t, src_E, h_D, ok_ED)
    partner_ED = _load_heads(x_ref, t, src_E, partner_D, ok_ED)
    return jnp.where(rot_D[None, :], x_ED * cos_1D + partner_ED * sin_1D, x_ED)


def _rope_kv_write_kernel(
    positions_T_ref,     # [T] int32
    inv_freq_TF_ref,     # [T, F] float32
    slot_mapping_T_ref,  # [T] int32 flat slots
    q_TNH_ref,           # [T, N, H]
    k_TKH_ref,           # [T, K, H]
    v_TKH_ref,           # [T, K, H]
    k_cache_in_ref,      # [Z, C, H] aliased by k_cache_ZCH_ref
    v_cache_in_ref,      # [Z, C, H] aliased by v_cache_ZCH_ref
    q_out_TNH_ref,       # [T, N, H] rotated q
    k_cache_ZCH_ref,     # [Z, C, H]: only row slot_mapping[t] is written
    v_cache_ZCH_ref,     # [Z, C, H]
    *, attention_scaling,
):
    del k_cache_in_ref, v_cache_in_ref  # the same buffers as the outputs
    t = pl.program_id(0)
    num_heads, head_dim = q_TNH_ref.shape[1:]
    num_kv_heads, cache_heads = k_TKH_ref.shape[1], k_cache_ZCH_ref.shape[1]
    tables = _rope_tables_D(positions_T_ref[t], inv_freq_TF_ref, t, head_dim, attention_scaling)
    h_ok_D = tables[0] < head_dim
    # q: every head of token t into the new array.
    n_E, _, n_ok_E = _head_lanes_E(num_heads)
    ok_ED = n_ok_E[:, None] & h_ok_D[None, :]
    q_ED = _rotate(q_TNH_ref, t, n_E, ok_ED, tables)
    _masked_store(q_out_TNH_ref.at[t, n_E[:, None], tables[0][None, :]], q_ED.astype(q_out_TNH_ref.dtype), ok_ED)
    # k, v: cache head c of slot slot_mapping[t] gets kv head c // r.
    slot = slot_mapping_T_ref[t]
    c_E, kv_E, c_ok_E = _head_lanes_E(cache_heads, cache_heads // num_kv_heads)
    ok_ED = c_ok_E[:, None] & h_ok_D[None, :]
    dst = (slot, c_E[:, None], tables[0][None, :])
    k_ED = _rotate(k_TKH_ref, t, kv_E, ok_ED, tables)
    _masked_store(k_cache_ZCH_ref.at[dst], k_ED.astype(k_cache_ZCH_ref.dtype), ok_ED)
    v_ED = _masked_load(v_TKH_ref.at[t, kv_E[:, None], tables[0][None, :]], ok_ED, 0.0)
    _masked_store(v_cache_ZCH_ref.at[dst], v_ED.astype(v_cache_ZCH_ref.dtype), ok_ED)


@functools.partial(jax.jit, static_argnames=("attention_scaling", "interpret"))
def _rope_kv_write_pallas(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH,
                          slot_mapping_T, *, attention_scaling, interpret):
    P, S, C, H = k_cache_PSKH.shape
    num_tokens, num_heads = q_TNH.shape[:2]
    widest = _next_pow2(max(num_heads, C)) * _next_pow2(H)
    kernel = functools.partial(_rope_kv_write_kernel, attention_scaling=float(attention_scaling))
    cache_ZCH = jax.ShapeDtypeStruct((P * S, C, H), k_cache_PSKH.dtype)
    q_TNH, k_ZCH, v_ZCH = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype), cache_ZCH, cache_ZCH),
        grid=(num_tokens,),
        input_output_aliases={6: 1, 7: 2},  # caches in place
        compiler_params=_triton_compiler_params(num_warps=8 if widest > 4096 else 4, num_stages=1),
        interpret=interpret,
        name="rope_kv_write",
    )(positions_T, inv_freq_TF, slot_mapping_T, q_TNH, k_TKH, v_TKH,
      k_cache_PSKH.reshape(P * S, C, H), v_cache_PSKH.reshape(P * S, C, H))
    return q_TNH, k_ZCH.reshape(P, S, C, H), v_ZCH.reshape(P, S, C, H)


def rope_kv_write_kernel(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                         k_cache_PSKH, v_cache_PSKH, slot_mapping_T, *, interpret: bool = False):
    """The Pallas kernel with rope_kv_write_reference's arguments and results."""
    validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T)
    return _rope_kv_write_pallas(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH,
                                 slot_mapping_T, attention_scaling=attention_scaling, interpret=interpret)


def rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                  k_cache_PSKH, v_cache_PSKH, slot_mapping_T, *, impl: str = "auto", interpret: bool = False):
    """Rotate q and k, write k and v into their cache slots: (q_TNH, k_cache_PSKH, v_cache_PSKH).

    impl: "auto" -> kernel on GPU (or with interpret=True), reference elsewhere; "kernel" or
    "reference" force one. Donate the caches to the enclosing jit so the update is in place.
    """
    validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T, impl)
    args = (q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling, k_cache_PSKH, v_cache_PSKH,
            slot_mapping_T)
    if impl == "reference" or (impl == "auto" and not (interpret or _on_gpu())):
        return rope_kv_write_reference(*args)
    return rope_kv_write_kernel(*args, interpret=interpret)
