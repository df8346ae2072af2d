"""Helpers every Pallas (Triton backend) kernel here shares: the jax 0.10 / 0.11 spellings of the
Triton backend (CPU runs jax 0.10.2, the GPU 0.11.2), masked loads and stores, integer division the
Triton lowering accepts, and what the device is."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # The Triton backend module; absent from some jax builds.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plgpu = None

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------
# jax version compatibility
# --------------------------------------------------------------------------
def _triton_compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params under whichever name this jax spells them."""
    for owner, name in ((plgpu, "CompilerParams"), (plgpu, "TritonCompilerParams"),
                        (pl, "TritonCompilerParams")):
        cls = getattr(owner, name, None) if owner is not None else None
        if cls is not None:
            return cls(num_warps=num_warps, num_stages=num_stages)
    return None


def _masked_load(ref, mask, other):
    """Load with a mask; `other` fills the masked-off elements (no memory access)."""
    if plgpu is not None and hasattr(plgpu, "load"):
        return plgpu.load(ref, mask=mask, other=other)
    return pl.load(ref, None, mask=mask, other=other)  # older jax spelling


def _masked_store(ref, val, mask):
    if plgpu is not None and hasattr(plgpu, "store"):
        return plgpu.store(ref, val, mask=mask)
    return pl.store(ref, None, val, mask=mask)


def _load_masked_if(ref, idx, mask, needed: bool, other):
    """ref[idx], masked (`other` off the mask) only where `needed`: unmasked loads where the shapes
    allow have no predication."""
    return _masked_load(ref.at[idx], mask, other) if needed else ref[idx]


# --------------------------------------------------------------------------
# Small integer codes to 16-bit floats without an int->float convert (a quarter-rate instruction)
# --------------------------------------------------------------------------
# OR-ing a code q (< 128 for bf16, < 1024 for float16) into the mantissa of M gives the float M + q
# exactly: (bits of M, M) per dtype.
EXPONENT_TRICK = {"bfloat16": (0x4300, 128.0), "float16": (0x6400, 1024.0)}


def plus_magic(codes_u16, dtype):
    """(M + codes in `dtype`, M) for uint16 codes below the dtype's limit (see EXPONENT_TRICK)."""
    bits, magic = EXPONENT_TRICK[jnp.dtype(dtype).name]
    return jax.lax.bitcast_convert_type(codes_u16 | bits, dtype), magic


# --------------------------------------------------------------------------
# Integer arithmetic
# --------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _div(x, d: int):
    """Division of non-negative ints: lax.div, not jnp's floor division, which
    adds sign fix-ups that the Triton lowering may not support."""
    return jax.lax.div(x, jnp.asarray(d, jnp.int32)) if not isinstance(x, int) else x // d


def _rem(x, d: int):
    return jax.lax.rem(x, jnp.asarray(d, jnp.int32))


# --------------------------------------------------------------------------
# The device
# --------------------------------------------------------------------------
def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", 0) or 132
