"""RoPE of q and k fused with the paged KV-cache write: one Pallas (Triton backend) launch per layer.

Why: a batch-1 decode step is launch-bound (~2-3 us a launch). Unfused, each layer runs a RoPE fusion
for q, a scatter fusion for K (with its RoPE) and one for V before attention; this op does all of it
in one kernel.

Two entry points: `rope_kv_write_qkv` takes the merged projection output qkv [T, N + 2K, H] (what
a model with one q/k/v weight computes: the kernel reads q, k and v straight from it), and
`rope_kv_write` takes q, k and v apart (concatenated first: a copy, for callers without a merged weight).

Status (H200, 2026-11-23): 3.9 us vs 6.3 us for the XLA path on 8B heads at one token, correct on
random inputs (rel. err 2.2e-3 in bf16, the reference's rounding). Fed separate q/k/v inside the decode
step it gained nothing: XLA copied q, k and v out of its merged projection GEMM for the custom call
(3 slice fusions, ~120 us a step on 8B); the merged entry point exists to avoid that copy.
With q split over several programs a token (2026-11-24, `bench_kv_write` of benchmarks/kernels_rope.py,
same run): 8B heads 3.3 / 3.7 / 5.0 us at T = 1 / 4 / 64 (one program a token: 5.5 / 8.2 / 9.9), 1B
heads 3.2 / 3.5 / 4.1 (4.0 / 4.6 / 5.3); the batch-1 decode step 4.468 -> 4.331 ms (8B), 1.086 -> 1.066 (1B).

Shape letters: T tokens, N query heads, K kv heads of k/v, X = N + 2K merged heads, C heads the cache stores (C = r * K: under
tensor parallelism the cache may repeat each kv head r times, cache head c holding kv head c // r),
H head dim, F = rotary_dim // 2 frequencies, P cache pages, S slots per page, Z = P * S flat slots.
In the kernel E = a head count padded to a power of two, D = H padded to a power of two.

Data flow: grid (token t, part p). Parts 0 .. Q-1 each rotate a block of E q heads of q[t] into a new
q; part Q rotates k[t] and stores it with v[t] at flat slot slot_mapping[t] of the caches. Each program
computes cos/sin of positions[t] * inv_freq[t] once per dimension (float32, scaled by
`attention_scaling`, rounded to the tensor's dtype as HF does). Why parts: with one program a token
(the first version) a batch-1 decode step ran 4 programs that each walked all heads: 6.2 us a layer
inside the 8B step; the parts spread one token's heads over more SMs. The caches are updated in place
(`input_output_aliases`): slots no token names keep their contents bit for bit. Numerics and argument
checks match `rope_kv_write_reference` (= HF rotate-half RoPE of pallas_kernels.rope, then the scatter
of lmjax's `write_kv`).

Repeated slots: two tokens naming one slot both write it; which one lands is unspecified (so in the
reference, XLA's scatter), element by element in the kernel. Slots outside [0, Z) are dropped, as XLA's
scatter drops them (a negative slot, which jnp would wrap, is dropped too; the engine makes neither). lmjax's engine repeats only the padding
sink (slot 0 of block 0, which no sequence reads), so its result equals the reference's wherever it
is ever read; see `tests/pallas_kernels/test_rope_kv_write.py`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._validate import require, require_dtype, require_rank
from pallas_kernels._pallas_util import (  # the shared Pallas helpers (not via the attention op)
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


def validate_qkv(qkv_TXH, num_kv_heads: int) -> None:
    require_rank("qkv_TXH", qkv_TXH, 3, "T, N + 2K, H")
    require(isinstance(num_kv_heads, int) and num_kv_heads > 0,
            f"num_kv_heads={num_kv_heads!r} must be a positive int")
    require(qkv_TXH.shape[1] > 2 * num_kv_heads,
            f"qkv_TXH.shape={tuple(qkv_TXH.shape)} must hold N + 2 * {num_kv_heads=} heads with N > 0")


def split_qkv(qkv_TXH, num_kv_heads: int):
    """(q_TNH, k_TKH, v_TKH) of a merged [T, N + 2K, H] projection output: q heads first, then k, then v."""
    validate_qkv(qkv_TXH, num_kv_heads)
    N = qkv_TXH.shape[1] - 2 * num_kv_heads
    return qkv_TXH[:, :N], qkv_TXH[:, N:N + num_kv_heads], qkv_TXH[:, N + num_kv_heads:]


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


def _head_lanes_E(heads: int, stride: int = 1, offset: int = 0):
    """Lane e of a [E, D] tile is head e of the output and reads merged head offset + e // stride;
    padded lanes point out of bounds of the output (masked off) and at head `offset` of the input."""
    e_E = jnp.arange(_next_pow2(heads), dtype=jnp.int32)
    ok_E = e_E < heads
    return jnp.where(ok_E, e_E, heads), offset + jnp.where(ok_E, e_E // stride, 0), ok_E


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


def _q_heads_per_program(num_heads: int, head_dim: int) -> int:
    """E: q heads a program rotates, a power of two: tiles of about 1024 elements (8 heads of 128)."""
    return max(1, min(_next_pow2(num_heads), 1024 // _next_pow2(head_dim)))


def _rope_kv_write_kernel(
    positions_T_ref,     # [T] int32
    inv_freq_TF_ref,     # [T, F] float32
    slot_mapping_T_ref,  # [T] int32 flat slots
    qkv_TXH_ref,         # [T, N + 2K, H]: q heads, then k, then v
    k_cache_in_ref,      # [Z, C, H] aliased by k_cache_ZCH_ref
    v_cache_in_ref,      # [Z, C, H] aliased by v_cache_ZCH_ref
    q_out_TNH_ref,       # [T, N, H] rotated q
    k_cache_ZCH_ref,     # [Z, C, H]: only row slot_mapping[t] is written
    v_cache_ZCH_ref,     # [Z, C, H]
    *, num_kv_heads, attention_scaling, q_block,
):
    del k_cache_in_ref, v_cache_in_ref  # the same buffers as the outputs
    t, part = pl.program_id(0), pl.program_id(1)
    num_heads, head_dim = q_out_TNH_ref.shape[1:]
    num_slots, cache_heads = k_cache_ZCH_ref.shape[:2]
    q_parts = -(-num_heads // q_block)
    tables = _rope_tables_D(positions_T_ref[t], inv_freq_TF_ref, t, head_dim, attention_scaling)
    h_ok_D = tables[0] < head_dim

    @pl.when(part < q_parts)
    def _q():  # q heads part * E .. part * E + E - 1 of token t into the new array
        n_E = part * q_block + jnp.arange(q_block, dtype=jnp.int32)
        n_ok_E = n_E < num_heads
        src_E = jnp.where(n_ok_E, n_E, 0)  # padded lanes read head 0 (masked) and store out of bounds
        n_E = jnp.where(n_ok_E, n_E, num_heads)
        ok_ED = n_ok_E[:, None] & h_ok_D[None, :]
        q_ED = _rotate(qkv_TXH_ref, t, src_E, ok_ED, tables)
        _masked_store(q_out_TNH_ref.at[t, n_E[:, None], tables[0][None, :]], q_ED.astype(q_out_TNH_ref.dtype),
                      ok_ED)

    @pl.when(part == q_parts)
    def _kv():  # cache head c of slot slot_mapping[t] gets kv head c // r (dropped when the slot is out of range)
        slot = slot_mapping_T_ref[t]
        stride = cache_heads // num_kv_heads
        c_E, k_src_E, c_ok_E = _head_lanes_E(cache_heads, stride, offset=num_heads)
        ok_ED = c_ok_E[:, None] & h_ok_D[None, :] & (slot >= 0) & (slot < num_slots)
        dst = (jnp.clip(slot, 0, num_slots - 1), c_E[:, None], tables[0][None, :])
        k_ED = _rotate(qkv_TXH_ref, t, k_src_E, ok_ED, tables)
        _masked_store(k_cache_ZCH_ref.at[dst], k_ED.astype(k_cache_ZCH_ref.dtype), ok_ED)
        v_src_E = k_src_E + num_kv_heads
        v_ED = _masked_load(qkv_TXH_ref.at[t, v_src_E[:, None], tables[0][None, :]], ok_ED, 0.0)
        _masked_store(v_cache_ZCH_ref.at[dst], v_ED.astype(v_cache_ZCH_ref.dtype), ok_ED)


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "attention_scaling", "interpret"))
def _rope_kv_write_pallas(qkv_TXH, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH, slot_mapping_T, *,
                          num_kv_heads, attention_scaling, interpret):
    P, S, C, H = k_cache_PSKH.shape
    num_tokens, num_heads = qkv_TXH.shape[0], qkv_TXH.shape[1] - 2 * num_kv_heads
    q_block = _q_heads_per_program(num_heads, H)
    widest = max(q_block, _next_pow2(C)) * _next_pow2(H)
    kernel = functools.partial(_rope_kv_write_kernel, num_kv_heads=num_kv_heads,
                               attention_scaling=float(attention_scaling), q_block=q_block)
    cache_ZCH = jax.ShapeDtypeStruct((P * S, C, H), k_cache_PSKH.dtype)
    q_TNH, k_ZCH, v_ZCH = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_tokens, num_heads, H), qkv_TXH.dtype), cache_ZCH, cache_ZCH),
        grid=(num_tokens, -(-num_heads // q_block) + 1),  # q blocks, then k / v
        input_output_aliases={4: 1, 5: 2},  # caches in place
        compiler_params=_triton_compiler_params(num_warps=8 if widest > 4096 else 4, num_stages=1),
        interpret=interpret,
        name="rope_kv_write",
    )(positions_T, inv_freq_TF, slot_mapping_T, qkv_TXH,
      k_cache_PSKH.reshape(P * S, C, H), v_cache_PSKH.reshape(P * S, C, H))
    return q_TNH, k_ZCH.reshape(P, S, C, H), v_ZCH.reshape(P, S, C, H)


def _merge_qkv(q_TNH, k_TKH, v_TKH):
    require(q_TNH.dtype == k_TKH.dtype == v_TKH.dtype,
            f"q_TNH.dtype={q_TNH.dtype}, k_TKH.dtype={k_TKH.dtype} and v_TKH.dtype={v_TKH.dtype} must be "
            "equal for the kernel")
    return jnp.concatenate([q_TNH, k_TKH, v_TKH], axis=1)


def rope_kv_write_kernel(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                         k_cache_PSKH, v_cache_PSKH, slot_mapping_T, *, interpret: bool = False):
    """The Pallas kernel with rope_kv_write_reference's arguments and results (q, k, v concatenated first)."""
    validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T)
    return _rope_kv_write_pallas(_merge_qkv(q_TNH, k_TKH, v_TKH), positions_T, inv_freq_TF, k_cache_PSKH,
                                 v_cache_PSKH, slot_mapping_T, num_kv_heads=k_TKH.shape[1],
                                 attention_scaling=attention_scaling, interpret=interpret)


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


def rope_kv_write_qkv(qkv_TXH, num_kv_heads: int, positions_T, inv_freq_TF, attention_scaling,
                      k_cache_PSKH, v_cache_PSKH, slot_mapping_T, *, impl: str = "auto",
                      interpret: bool = False):
    """`rope_kv_write` of a merged projection output qkv_TXH = [q | k | v] heads: (q_TNH, k_cache, v_cache).

    The kernel reads q, k and v in place from qkv_TXH (no split copies); the reference splits it."""
    q_TNH, k_TKH, v_TKH = split_qkv(qkv_TXH, num_kv_heads)
    validate_rope_kv_write(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                           k_cache_PSKH, v_cache_PSKH, slot_mapping_T, impl)
    if impl == "reference" or (impl == "auto" and not (interpret or _on_gpu())):
        return rope_kv_write_reference(q_TNH, k_TKH, v_TKH, positions_T, inv_freq_TF, attention_scaling,
                                       k_cache_PSKH, v_cache_PSKH, slot_mapping_T)
    return _rope_kv_write_pallas(qkv_TXH, positions_T, inv_freq_TF, k_cache_PSKH, v_cache_PSKH, slot_mapping_T,
                                 num_kv_heads=num_kv_heads, attention_scaling=attention_scaling,
                                 interpret=interpret)
