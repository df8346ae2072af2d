"""Rotary position embeddings: the frequency math of every supported variant, and the jnp reference.

Shape letters: T tokens, N heads, H head dim, F = rotary_dim // 2 frequencies.

Variants follow transformers' `modeling_rope_utils` semantics exactly (the parity tests hold us to it):
- default: inv_freq[f] = 1 / theta ** (2f / rotary_dim)
- linear: inv_freq / factor (position interpolation)
- dynamic (NTK): once a sequence is longer than `max_position_embeddings`, the base is recomputed from
  the *current sequence length* L: theta * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2)).
  Every token carries the length of its own sequence (`seq_lens_T`), so one batch can mix sequences
  below and beyond the trained context.
- llama3: wavelength-dependent interpolation between inv_freq and inv_freq / factor.

Rotation is the NeoX / HF "rotate half" layout: the first and second halves of the rotary dims pair up.
Only the first `rotary_dim` dims rotate (partial rotary); the rest pass through.
This module imports jax only: the engine's layers and the Pallas kernel both build on it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Static description of a model's RoPE (hashable: it is a jit static argument)."""

    rotary_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    attention_scaling: float = 1.0
    # llama.cpp's rope_freqs (a GGUF of Llama 3.1+ carries its llama3 RoPE only so): each inverse frequency is
    # divided by its factor, on top of the type's own (rotary_dim // 2 positive floats)
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        validate_rope_spec(self)

    @property
    def is_dynamic(self) -> bool:
        return self.rope_type == "dynamic"


def validate_rope_spec(spec: RopeSpec) -> None:
    if spec.rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={spec.rope_type!r} is not supported; supported: {ROPE_TYPES}")
    if spec.rotary_dim <= 0 or spec.rotary_dim % 2:
        raise ValueError(f"rotary_dim={spec.rotary_dim} must be a positive even number")
    if spec.theta <= 0:
        raise ValueError(f"rope theta={spec.theta} must be positive")
    if spec.rope_type != "default" and spec.factor <= 0:
        raise ValueError(f"rope factor={spec.factor} must be positive for rope_type={spec.rope_type!r}")
    if spec.rope_type == "llama3" and spec.original_max_position_embeddings is None:
        raise ValueError("rope_type='llama3' needs original_max_position_embeddings")
    if spec.rope_type == "llama3" and spec.high_freq_factor <= spec.low_freq_factor:
        raise ValueError(f"llama3 rope needs {spec.high_freq_factor=} > {spec.low_freq_factor=}")
    factors = spec.freq_factors
    if factors is not None and (len(factors) != spec.rotary_dim // 2 or not all(f > 0 for f in factors)):
        raise ValueError(f"rope freq_factors must be {spec.rotary_dim // 2} positive floats (rotary_dim // 2), "
                         f"got {len(factors)}: {list(factors)[:4]}...")


def _base_inv_freq_F(theta, rotary_dim: int) -> jax.Array:
    exponents_F = jnp.arange(0, rotary_dim, 2, dtype=jnp.int32).astype(jnp.float32) / rotary_dim
    return 1.0 / (jnp.asarray(theta, jnp.float32) ** exponents_F)


def _llama3_inv_freq_F(spec: RopeSpec) -> jax.Array:
    inv_freq_F = _base_inv_freq_F(spec.theta, spec.rotary_dim)
    old_len = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / spec.low_freq_factor, old_len / spec.high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    scaled_F = jnp.where(wavelen_F > low_wavelen, inv_freq_F / spec.factor, inv_freq_F)
    smooth_F = (old_len / wavelen_F - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed_F = (1 - smooth_F) * scaled_F / spec.factor + smooth_F * scaled_F
    is_medium_F = ~(wavelen_F < high_wavelen) & ~(wavelen_F > low_wavelen)
    return jnp.where(is_medium_F, smoothed_F, scaled_F)


def static_inv_freq_F(spec: RopeSpec) -> jax.Array:
    """inv_freq for the variants that do not depend on the sequence length."""
    if spec.rope_type == "linear":
        inv_freq_F = _base_inv_freq_F(spec.theta, spec.rotary_dim) / spec.factor
    elif spec.rope_type == "llama3":
        inv_freq_F = _llama3_inv_freq_F(spec)
    else:
        inv_freq_F = _base_inv_freq_F(spec.theta, spec.rotary_dim)
    return _with_freq_factors(inv_freq_F, spec)


def _with_freq_factors(inv_freq_xF: jax.Array, spec: RopeSpec) -> jax.Array:
    if spec.freq_factors is None:
        return inv_freq_xF
    return inv_freq_xF / jnp.asarray(spec.freq_factors, jnp.float32)


def dynamic_inv_freq_TF(spec: RopeSpec, seq_lens_T: jax.Array) -> jax.Array:
    """Dynamic NTK: per-token inv_freq from the length of the token's sequence (float32, like HF)."""
    max_pos = spec.max_position_embeddings
    seq_len_T = jnp.maximum(seq_lens_T, max_pos).astype(jnp.float32)
    dim = spec.rotary_dim
    base_T = spec.theta * ((spec.factor * seq_len_T / max_pos) - (spec.factor - 1)) ** (dim / (dim - 2))
    exponents_F = jnp.arange(0, dim, 2, dtype=jnp.int32).astype(jnp.float32) / dim
    return _with_freq_factors(1.0 / (base_T[:, None] ** exponents_F[None, :]), spec)


def inv_freq_TF(spec: RopeSpec, seq_lens_T: jax.Array) -> jax.Array:
    """Per-token inverse frequencies [T, F] for any variant."""
    if spec.is_dynamic:
        return dynamic_inv_freq_TF(spec, seq_lens_T)
    inv_freq_F = static_inv_freq_F(spec)
    return jnp.broadcast_to(inv_freq_F[None, :], (seq_lens_T.shape[0], inv_freq_F.shape[0]))


def cos_sin_TF(positions_T: jax.Array, inv_freq_TF_: jax.Array, attention_scaling: float = 1.0):
    """cos and sin of position * inv_freq, float32, scaled like HF's `attention_scaling`."""
    angles_TF = positions_T.astype(jnp.float32)[:, None] * inv_freq_TF_
    return jnp.cos(angles_TF) * attention_scaling, jnp.sin(angles_TF) * attention_scaling


def validate_rope_args(x_TNH: jax.Array, positions_T: jax.Array, inv_freq_TF_: jax.Array) -> None:
    """Shared by the reference and the kernel: shapes must agree, rotary dims must fit the head."""
    if x_TNH.ndim != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {x_TNH.shape}")
    T, _, H = x_TNH.shape
    if positions_T.shape != (T,):
        raise ValueError(f"positions shape {positions_T.shape} must be ({T},) to match x {x_TNH.shape}")
    if inv_freq_TF_.ndim != 2 or inv_freq_TF_.shape[0] != T:
        raise ValueError(f"inv_freq shape {inv_freq_TF_.shape} must be ({T}, rotary_dim // 2)")
    if 2 * inv_freq_TF_.shape[1] > H:
        raise ValueError(f"rotary_dim={2 * inv_freq_TF_.shape[1]} exceeds head_dim={H}")


def apply_rope_reference(
    x_TNH: jax.Array, positions_T: jax.Array, inv_freq_TF_: jax.Array, attention_scaling: float = 1.0
) -> jax.Array:
    """Rotate the first 2F dims of every head of x by its token's position (HF rotate-half layout).

    cos/sin are computed in float32 and cast to x's dtype before the multiply, as HF does, so bf16 runs
    round the same way as transformers.
    """
    validate_rope_args(x_TNH, positions_T, inv_freq_TF_)
    F = inv_freq_TF_.shape[1]
    cos_TF, sin_TF = cos_sin_TF(positions_T, inv_freq_TF_, attention_scaling)
    cos_T1R = jnp.concatenate([cos_TF, cos_TF], axis=-1)[:, None, :].astype(x_TNH.dtype)
    sin_T1R = jnp.concatenate([sin_TF, sin_TF], axis=-1)[:, None, :].astype(x_TNH.dtype)
    rot_TNR, pass_TNX = x_TNH[..., : 2 * F], x_TNH[..., 2 * F :]
    half_a, half_b = rot_TNR[..., :F], rot_TNR[..., F:]
    rotated_half_TNR = jnp.concatenate([-half_b, half_a], axis=-1)
    out_TNR = rot_TNR * cos_T1R + rotated_half_TNR * sin_T1R
    return jnp.concatenate([out_TNR, pass_TNX], axis=-1) if pass_TNX.shape[-1] else out_TNR
