"""Linear layers stored out-major, kernel [out, in] (torch's layout), for the one-row decode path.

Why: at batch 1 a decode step is launch-bound, and XLA's GEMMs over [in, out] weights need a split-K
reduction launch at one row, which keeps every RMSNorm, residual add and SwiGLU a launch of its own.
Over an out-major weight, pallas_kernels/gemv_om.py reads whole output rows per program: no reduction
launch, and the "add residual, then RMSNorm" before q/k/v and gate/up, and the SwiGLU after gate/up,
fuse into the GEMV (`project_normed`); the q/k/v GEMV also takes RoPE and the KV-cache write
(`project_qkv_rope`, pallas_kernels/gemv_om_qkv.py). Rows above gemv_om.MAX_T take XLA's dot over the same weight
(dot_general contracting both operands' last axes: cuBLAS / Triton read it transposed, no copy).

The engine converts a loaded model once (`to_out_major`; LMJAX_DECODE_GEMV, `out_major_wanted`);
checkpoints, the loaders and tensor-parallel sharding rules keep the [in, out] Linear.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lmjax.env import env_choice
from lmjax.layers.linear import Linear
from lmjax.layers.norm import RMSNorm
from pallas_kernels.gemv_om import MAX_T, gemv_om
from pallas_kernels.gemv_om_qkv import gemv_om_qkv

DECODE_GEMV_CHOICES = ("auto", "on", "off")


# "auto" converts models up to this hidden size: the small weights of a 1B step are where XLA's one-row
# GEMMs and their neighbouring launches lose most (H200, 2026-11-24: 1B faster, 8B slower, BENCHMARKS.md).
AUTO_MAX_HIDDEN = 2048


def decode_gemv_mode(value: str | None = None) -> str:
    """LMJAX_DECODE_GEMV: "auto", "on" (also on CPU, the kernel in interpret mode: tests), "off"."""
    return env_choice("LMJAX_DECODE_GEMV", DECODE_GEMV_CHOICES, "auto", value, label="decode gemv")


def out_major_wanted(hidden_size: int, value: str | None = None) -> bool:
    """Whether the engine converts a model (one device, float KV cache): "on", or "auto" on a GPU for
    hidden sizes up to AUTO_MAX_HIDDEN."""
    mode = decode_gemv_mode(value)
    if mode == "auto":
        return jax.default_backend() == "gpu" and hidden_size <= AUTO_MAX_HIDDEN
    return mode == "on"


def gemv_rows(T: int) -> bool:
    """Whether T rows go through the GEMV kernel (else XLA's dot)."""
    return T <= MAX_T


class OutMajorLinear(nnx.Module):
    """y = x @ kernel.T, kernel [O, I], no bias (layers with a bias stay `Linear`)."""

    def __init__(self, kernel_OI: jax.Array):
        self.kernel = nnx.Param(kernel_OI)

    @classmethod
    def from_linear(cls, layer: Linear) -> OutMajorLinear:
        """The same layer with its kernel transposed once (a new array on the same device)."""
        if layer.bias is not None:
            raise ValueError("OutMajorLinear takes layers without a bias")
        return cls(jnp.asarray(layer.kernel[...]).T)

    def __call__(self, x_TI: jax.Array) -> jax.Array:
        if gemv_rows(x_TI.shape[0]):
            return gemv_om(x_TI, self.kernel[...])[0]
        return jax.lax.dot_general(x_TI, self.kernel[...], (((1,), (1,)), ((), ())))

    def project_normed(self, x_TI, residual_TI, norm: RMSNorm, *, swiglu: bool = False):
        """(y, s): s = x + residual (x when residual is None), y = this layer over norm(s), SwiGLU'd
        when `swiglu` (the kernel then holds [gate; up] rows). One launch for few rows."""
        if gemv_rows(x_TI.shape[0]):
            return gemv_om(x_TI, self.kernel[...], residual_TI=residual_TI, norm_weight_I=norm.weight[...],
                           eps=norm.eps, swiglu=swiglu)
        h_TI, s_TI = norm.add_and_norm(x_TI, residual_TI)
        y_TO = self(h_TI)
        if swiglu:
            gate_TP, up_TP = jnp.split(y_TO, 2, axis=-1)
            y_TO = jax.nn.silu(gate_TP) * up_TP
        return y_TO, s_TI

    def project_qkv_rope(self, x_TI, residual_TI, norm: RMSNorm, *, num_kv_heads: int, head_dim: int, positions_T,
                         inv_freq_TF, attention_scaling: float, cache, slot_mapping_T):
        """(q_TNH, cache, s): this merged q/k/v layer over norm(x + residual), q and k rotated, k and v
        written into the float cache at their slots, in one launch (<= MAX_T rows, full rotary)."""
        q_TNH, k_cache, v_cache, s_TI = gemv_om_qkv(
            x_TI, self.kernel[...], residual_TI=residual_TI, norm_weight_I=norm.weight[...], eps=norm.eps,
            num_kv_heads=num_kv_heads, head_dim=head_dim, positions_T=positions_T, inv_freq_TF=inv_freq_TF,
            attention_scaling=attention_scaling, k_cache_PSKH=cache[0], v_cache_PSKH=cache[1],
            slot_mapping_T=slot_mapping_T)
        return q_TNH, (k_cache, v_cache), s_TI
