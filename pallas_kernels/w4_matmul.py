"""int4-weight matmul for small token counts (decode): y = x @ dequant(packed, scale, offset).

Layout (that of lmjax.layers.quant's w4):
  packed_JO  uint8 [I/2, O]: row 2j of w in the low nibble, row 2j+1 in the high one
  scale_gO, offset_gO  [ceil(I/G), O]: w[i, o] = q[i, o] * scale[i // G, o] + offset[i // G, o]
A last group shorter than G is allowed.

Decode is bandwidth bound: both paths read each packed byte once and never write bf16 weights to
HBM. Per group g and output block the algebra is
  part = x_even_g @ low_g + x_odd_g @ high_g                  (exact small ints, float32 sums)
  acc += part * scale[g] + sum(x_g) * offset[g]               (the offset term needs only sum(x_g))
Grid = (output blocks, K splits): each program takes a contiguous range of the input rows, so that
narrow matrices (O = 1024) still fill the SMs; per-split float32 partials are summed by XLA afterwards
(one split writes x's dtype directly).

Two paths, picked statically by T (`path=` forces one):
  gemv (T = 1 by default, up to GEMV_MAX_T when forced; decode): no dot, the packed bytes streamed
    in wide row-major tiles and unpacked in registers: pallas_kernels/w4_gemv.py.
  dot (larger T): T padded to 16 rows (Triton's dot minimum), two dots per group
    [P, G/2] x [G/2, block_o]; only the T real rows are stored. For bf16 / f16 x the weight operands
    are M + q (the nibble OR-ed into the mantissa of M = 128 / 1024: exact, no int->float convert,
    which the SM issues at a quarter rate), and per group
      part = x_g @ (M + q_g) = x_g @ q_g + M * sum(x_g)
      acc += part * scale[g] + sum(x_g) * (offset[g] - M * scale[g])
    (float32 sums: the M * sum(x_g) term costs ~5 of their 24 bits). float32 x converts (2**23 + q
    would cancel every bit). Measured (H200, 2026-11-24, 8B layer): 15-25% faster than converting
    (`config={"unpack": "convert"}`) at T = 1..64.

Shape letters: T tokens, I input dim, J = I/2 packed rows, O output dim, G group size, g groups,
H = G/2 packed rows per group, B output block, X splits, P padded tokens, C packed rows per chunk
(a chunk lies inside one group: C = min(rows, H)).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas_util import (  # jax 0.10 / 0.11 spellings of the Triton backend
    EXPONENT_TRICK,
    FLOAT_DTYPES,
    _div,
    _load_masked_if,
    _masked_load,
    _masked_store,
    _num_sms,
    _on_gpu,
    _triton_compiler_params,
    plus_magic,
)
from pallas_kernels._validate import (
    IMPLS,
    is_power_of_two,
    require,
    require_dim,
    require_dtype,
    require_impl,
    require_rank,
)
from pallas_kernels.w4_gemv import (
    GEMV_MAX_T,
    GEMV_TUNABLES,
    MAGIC,
    MAGIC_BITS,
    UNPACKS,
    _choose_gemv_config,
    _gemv_impl,
    _gemv_kernel,
    _unpack,
)

__all__ = [  # this module's ops and, re-exported, the gemv path's names and the helpers it imported
    "w4_matmul", "w4_matmul_kernel", "w4_matmul_reference", "validate_w4_matmul", "kernel_supports",
    "choose_path", "packed_bytes", "IMPLS", "FLOAT_DTYPES", "PATHS", "TUNABLES", "GEMV_TUNABLES", "UNPACKS",
    "MIN_ROWS", "DOT_UNPACKS", "GEMV_MAX_T", "MAGIC_BITS", "MAGIC", "_choose_gemv_config", "_unpack", "_gemv_kernel",
    "_gemv_impl", "_div", "_masked_load", "_masked_store", "_num_sms", "_on_gpu", "_triton_compiler_params",
]

PATHS = ("auto", "gemv", "dot")
TUNABLES = ("block_o", "num_splits", "num_warps", "num_stages", "unpack")  # the dot path's
DOT_UNPACKS = ("magic", "convert")  # magic: M + q for 16-bit x (_pallas_util.plus_magic), else converts
MIN_ROWS = 16  # Triton's dot needs every dim >= 16


# --------------------------------------------------------------------------
# Validation (shared by kernel and reference)
# --------------------------------------------------------------------------
def validate_w4_matmul(x_TI, packed_JO, scale_gO, offset_gO, group_size, *, impl="auto", config=None,
                       path="auto"):
    require_rank("x_TI", x_TI, 2, "T, I")
    require_rank("packed_JO", packed_JO, 2, "I/2, O")
    require_dtype("x_TI", x_TI, FLOAT_DTYPES)
    require_dtype("packed_JO", packed_JO, ("uint8",))
    require(isinstance(group_size, int) and group_size > 0 and group_size % 2 == 0,
            f"group_size={group_size!r} must be a positive even int")
    I, O = x_TI.shape[1], packed_JO.shape[1]
    require_dim("packed_JO", packed_JO, 0, I // 2, "I/2 (x_TI's last dim halved)")
    require(I % 2 == 0, f"x_TI.shape={tuple(x_TI.shape)}: I={I} must be even (two values per byte)")
    groups = -(-I // group_size)
    for name, arr in (("scale_gO", scale_gO), ("offset_gO", offset_gO)):
        require_rank(name, arr, 2, "ceil(I/G), O")
        require_dtype(name, arr, FLOAT_DTYPES)
        require(tuple(arr.shape) == (groups, O),
                f"{name}.shape={tuple(arr.shape)} must be (ceil(I/G), O)={(groups, O)}")
    require_impl(impl)
    require(path in PATHS, f"path={path!r} must be one of {PATHS}")
    T = x_TI.shape[0]
    require(path != "gemv" or T <= GEMV_MAX_T, f"path='gemv' needs T={T} <= GEMV_MAX_T={GEMV_MAX_T}")
    _validate_config(config, choose_path(T, path))


def _validate_config(config, path):
    tunables = GEMV_TUNABLES if path == "gemv" else TUNABLES
    for key, value in (config or {}).items():
        require(key in tunables, f"config key {key!r} must be one of {tunables} (path {path!r})")
        if key == "unpack":
            unpacks = UNPACKS if path == "gemv" else DOT_UNPACKS
            require(value in unpacks, f"config['unpack']={value!r} must be one of {unpacks} (path {path!r})")
        elif key == "prefetch":
            require(isinstance(value, bool), f"config['prefetch']={value!r} must be a bool")
        else:
            require(isinstance(value, int) and value > 0, f"config[{key!r}]={value!r} must be a positive int")
    config = config or {}
    if "block_o" in config:
        b = config["block_o"]
        require(b >= 16 and is_power_of_two(b), f"config['block_o']={b} must be a power of two >= 16")
        require(b >= 64 or config.get("unpack") != "bf16x2",
                f"config['block_o']={b} must be >= 64 with unpack='bf16x2' (the PTX takes 4 bytes a thread)")
    if "rows" in config:
        r = config["rows"]
        require(r >= 2 and is_power_of_two(r), f"config['rows']={r} must be a power of two >= 2")


def choose_path(T: int, path: str = "auto") -> str:
    """The static choice: "gemv" for one token, "dot" otherwise; a forced path is kept. Measured on an
    H200 (8B shapes, 2026-11-23): at T = 1 the gemv path is 1.15x the dot path a decoder layer; at T = 4
    it is 2.7x slower (its FMAs per token add up), so "auto" never takes it past T = 1."""
    if path != "auto":
        return path
    return "gemv" if T == 1 else "dot"


# --------------------------------------------------------------------------
# Reference (jnp): the kernel's algebra, group by group, in float32
# --------------------------------------------------------------------------
def _pad_groups(x_TI, group_size):
    """x [T, I] -> [T, g, G] float32, the last group zero padded (x only: weights are never copied)."""
    T, I = x_TI.shape
    groups = -(-I // group_size)
    x = jnp.pad(x_TI.astype(jnp.float32), ((0, 0), (0, groups * group_size - I)))
    return x.reshape(T, groups, group_size)


def w4_matmul_reference(x_TI, packed_JO, scale_gO, offset_gO, group_size: int):
    """x @ (q * scale + offset) with float32 accumulation, in x's dtype."""
    validate_w4_matmul(x_TI, packed_JO, scale_gO, offset_gO, group_size)
    J, O = packed_JO.shape
    groups = scale_gO.shape[0]
    q_IO = jnp.stack([packed_JO & 0xF, packed_JO >> 4], axis=1).reshape(2 * J, O).astype(jnp.float32)
    q_gGO = jnp.pad(q_IO, ((0, groups * group_size - 2 * J), (0, 0))).reshape(groups, group_size, O)
    x_TgG = _pad_groups(x_TI, group_size)
    hi = jax.lax.Precision.HIGHEST
    part_TgO = jnp.einsum("tgk,gko->tgo", x_TgG, q_gGO, precision=hi)
    y_TO = jnp.einsum("tgo,go->to", part_TgO, scale_gO.astype(jnp.float32), precision=hi)
    y_TO += jnp.matmul(x_TgG.sum(-1), offset_gO.astype(jnp.float32), precision=hi)
    return y_TO.astype(x_TI.dtype)



# --------------------------------------------------------------------------
# Kernel, dot path (larger T)
# --------------------------------------------------------------------------
def _choose_config(T, J, O, groups, on_gpu, block_o=None, num_splits=None, num_warps=4, num_stages=3,
                   unpack="magic"):
    """Output block and K splits: aim for >= 2 programs per SM (decode leaves one wave otherwise
    idle), never a split without groups."""
    block_o = block_o or (128 if O >= 2048 else 64)
    o_blocks = -(-O // block_o)
    if num_splits is None:
        target = 2 * _num_sms() if on_gpu else 1
        num_splits = max(1, -(-target // o_blocks))
    per_split = -(-groups // min(num_splits, groups))
    return dict(block_o=block_o, o_blocks=o_blocks, per_split=per_split,
                num_splits=-(-groups // per_split), num_warps=num_warps, num_stages=num_stages, unpack=unpack)


def _w4_kernel(x_even_PJ_ref, x_odd_PJ_ref, xsum_gP_ref, packed_JO_ref, scale_gO_ref, offset_gO_ref,
               out_XTO_ref, *, T, half_group, block_o, per_split, mask_rows, mask_cols, precision, magic):
    """One (output block, split): accumulate its groups' contributions in float32, store the T rows."""
    ob, split = pl.program_id(0), pl.program_id(1)
    P, J = x_even_PJ_ref.shape
    groups, O = scale_gO_ref.shape
    p_P = jnp.arange(P, dtype=jnp.int32)
    o_B = ob * block_o + jnp.arange(block_o, dtype=jnp.int32)
    col_ok_B = o_B < O
    # Out-of-range indices are clamped (and their loads masked) so interpret mode never reads past
    # the end; the GPU only sees the mask.
    o_B = jnp.where(col_ok_B, o_B, 0) if mask_cols else o_B
    h_H = jnp.arange(half_group, dtype=jnp.int32)
    dtype = x_even_PJ_ref.dtype
    g_lo = split * per_split
    g_hi = jnp.minimum(g_lo + per_split, groups)

    load = _load_masked_if  # unmasked loads where the shapes allow: no predication in the common (8B) case

    def body(g, acc_PB):
        j_H = g * half_group + h_H
        row_ok_H = j_H < J
        j_H = jnp.where(row_ok_H, j_H, 0) if mask_rows else j_H
        mask_HB = row_ok_H[:, None] & col_ok_B[None, :]
        p_HB = load(packed_JO_ref, (j_H[:, None], o_B[None, :]), mask_HB, mask_rows or mask_cols, 0)
        xe_PH = load(x_even_PJ_ref, (p_P[:, None], j_H[None, :]), row_ok_H[None, :], mask_rows, 0.0)
        xo_PH = load(x_odd_PJ_ref, (p_P[:, None], j_H[None, :]), row_ok_H[None, :], mask_rows, 0.0)
        if magic:  # M + q (see the module docstring)
            w_HB = p_HB.astype(jnp.uint16)
            low_HB, m = plus_magic(w_HB & 0xF, dtype)
            high_HB, _ = plus_magic(w_HB >> 4, dtype)
        else:
            low_HB = (p_HB & 0xF).astype(dtype)
            high_HB = (p_HB >> 4).astype(dtype)
        dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=precision)
        part_PB = dot(xe_PH, low_HB) + dot(xo_PH, high_HB)
        scale_B = load(scale_gO_ref, (g, o_B), col_ok_B, mask_cols, 0.0).astype(jnp.float32)
        offset_B = load(offset_gO_ref, (g, o_B), col_ok_B, mask_cols, 0.0).astype(jnp.float32)
        if magic:
            offset_B = offset_B - m * scale_B
        xsum_P = xsum_gP_ref[g, p_P]
        return acc_PB + part_PB * scale_B[None, :] + xsum_P[:, None] * offset_B[None, :]

    acc_PB = jax.lax.fori_loop(g_lo, g_hi, body, jnp.zeros((P, block_o), jnp.float32))
    # Padding rows (p >= T) are never stored: the partials hold only the real tokens. Masked-off
    # stores get an out-of-bounds index: interpret mode drops their scatter instead of racing a
    # real element with it (as in ragged_paged_attention_kernel.py); the GPU only sees the mask.
    row_ok_P = p_P < T
    store_mask_PB = row_ok_P[:, None] & col_ok_B[None, :]
    p_P = jnp.where(row_ok_P, p_P, T)
    o_B = jnp.where(col_ok_B, o_B, O) if mask_cols else o_B
    _masked_store(out_XTO_ref.at[split, p_P[:, None], o_B[None, :]], acc_PB, store_mask_PB)


def _dot_impl(x_TI, packed_JO, scale_gO, offset_gO, *, group_size, interpret, config):
    T, I = x_TI.shape
    J, O = packed_JO.shape
    groups = scale_gO.shape[0]
    cfg = _choose_config(T, J, O, groups, on_gpu=not interpret and _on_gpu(), **(config or {}))
    P = max(MIN_ROWS, 1 << (T - 1).bit_length())  # Triton block dims are powers of two
    x_PI = jnp.pad(x_TI, ((0, P - T), (0, 0)))
    xsum_gP = _pad_groups(x_PI, group_size).sum(-1).T  # per-group sums of x, for the offset term
    f32 = x_TI.dtype == jnp.float32
    kernel = functools.partial(
        _w4_kernel, T=T, half_group=group_size // 2, block_o=cfg["block_o"], per_split=cfg["per_split"],
        mask_rows=I % group_size != 0, mask_cols=O % cfg["block_o"] != 0,
        # float32 inputs get full-precision dots (Triton's default would be tf32)
        precision=jax.lax.Precision.HIGHEST if f32 else None,
        magic=cfg["unpack"] == "magic" and jnp.dtype(x_TI.dtype).name in EXPONENT_TRICK)
    partial_XTO = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg["num_splits"], T, O), jnp.float32),
        grid=(cfg["o_blocks"], cfg["num_splits"]),
        compiler_params=_triton_compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="w4_matmul",
    )(x_PI[:, 0::2], x_PI[:, 1::2], xsum_gP, packed_JO, scale_gO, offset_gO)
    return partial_XTO.sum(0).astype(x_TI.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "config", "path"))
def _kernel_jit(x_TI, packed_JO, scale_gO, offset_gO, *, group_size, interpret, config, path):
    impl = _gemv_impl if path == "gemv" else _dot_impl
    return impl(x_TI, packed_JO, scale_gO, offset_gO, group_size=group_size, interpret=interpret,
                config=None if config is None else dict(config))


def kernel_supports(group_size: int) -> bool:
    """A group is a Triton block of G/2 packed rows: a power of two, and >= 16 for the dot."""
    return is_power_of_two(group_size) and group_size >= 2 * MIN_ROWS


def w4_matmul_kernel(x_TI, packed_JO, scale_gO, offset_gO, group_size: int, *, interpret: bool = False,
                     config: dict | None = None, path: str = "auto"):
    """Pallas (Triton) kernel. path "auto": gemv for T = 1, dot otherwise; "gemv" / "dot" force
    one. `config` (keys in GEMV_TUNABLES or TUNABLES, the path's) overrides the tiling heuristic."""
    validate_w4_matmul(x_TI, packed_JO, scale_gO, offset_gO, group_size, config=config, path=path)
    require(kernel_supports(group_size), f"group_size={group_size} must be a power of two >= {2 * MIN_ROWS} "
            "for the kernel (use impl='reference')")
    frozen = None if config is None else tuple(sorted(config.items()))
    return _kernel_jit(x_TI, packed_JO, scale_gO, offset_gO, group_size=group_size, interpret=interpret,
                       config=frozen, path=choose_path(x_TI.shape[0], path))


# --------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------
def w4_matmul(x_TI, packed_JO, scale_gO, offset_gO, group_size: int, *, impl: str = "auto",
              interpret: bool = False, path: str = "auto"):
    """y_TO = x_TI @ dequant(packed, scale, offset) in x's dtype. impl "auto": the kernel on GPU (or
    with interpret=True), the jnp reference elsewhere; "kernel" / "reference" force one. path: the
    kernel's (see w4_matmul_kernel)."""
    validate_w4_matmul(x_TI, packed_JO, scale_gO, offset_gO, group_size, impl=impl, path=path)
    if impl == "kernel" or (impl == "auto" and (interpret or _on_gpu()) and kernel_supports(group_size)):
        return w4_matmul_kernel(x_TI, packed_JO, scale_gO, offset_gO, group_size, interpret=interpret,
                                path=path)
    return w4_matmul_reference(x_TI, packed_JO, scale_gO, offset_gO, group_size)


def packed_bytes(I: int, O: int, group_size: int, scale_itemsize: int = 2) -> int:
    """HBM bytes of one w4 weight: packed nibbles plus scale and offset."""
    return I // 2 * O + 2 * math.ceil(I / group_size) * O * scale_itemsize
