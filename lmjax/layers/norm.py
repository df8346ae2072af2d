"""RMSNorm as in HF Llama: statistics in float32, weight applied after casting back to the input dtype.

`RMSNorm.add_and_norm` adds a residual first and returns both the normed rows and the sum, the way
vLLM's decoder carries its residual stream: one call per add + norm pair of a layer. By default it is
the plain XLA computation (`s = x + residual`, then `self(s)`), bit for bit the unfused model. With
LMJAX_NORM_IMPL=kernel (read at trace time) it is one fused Pallas launch
(pallas_kernels.add_rms_norm): a batch-1 decode step is launch-bound, and the add and the norm are
two XLA launches each. Opt-in only: measured no faster on an H200 (8B batch-1 decode 4.657 vs 4.533 ms a
step, 2026-11-23, BENCHMARKS.md session 6). Why (1B profile, 2026-11-24, session 11): XLA runs the o and
down GEMMs split-K and folds the residual add into their reduction; with the add here, that reduction
becomes a launch of its own, and those launches cost what the fusion saves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from lmjax import parallel
from lmjax.env import env_choice
from pallas_kernels.add_rms_norm import add_rms_norm

NORM_IMPLS = ("xla", "kernel")


def norm_impl(impl: str | None = None) -> str:
    """"xla" (the default) or "kernel" for `RMSNorm.add_and_norm`: `impl`, else LMJAX_NORM_IMPL."""
    return env_choice("LMJAX_NORM_IMPL", NORM_IMPLS, "xla", impl, label="norm impl")


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        x32_TD = x_TD.astype(jnp.float32)
        variance_T1 = jnp.mean(x32_TD * x32_TD, axis=-1, keepdims=True)
        normed_TD = (x32_TD * jax.lax.rsqrt(variance_T1 + self.eps)).astype(x_TD.dtype)
        return self.weight[...] * normed_TD

    def add_and_norm(self, x_TD: jax.Array, residual_TD: jax.Array | None,
                     *, impl: str | None = None) -> tuple[jax.Array, jax.Array]:
        """(normed_TD, new_residual_TD) = (self(x + residual), x + residual); residual None: no add
        (new_residual is x). impl: "xla" or "kernel", by default LMJAX_NORM_IMPL (see `norm_impl`)."""
        if norm_impl(impl) == "xla":
            s_TD = x_TD if residual_TD is None else x_TD + residual_TD
            return self(s_TD), s_TD
        return _fused(x_TD, residual_TD, self.weight[...], float(self.eps))


def _fused(x_TD, residual_TD, weight_D, eps: float):
    """The Pallas kernel (interpret mode off GPU). Under a tp mesh the hidden states are replicated
    (lmjax.parallel shards no `embed` axis): each device normalizes its own full copy in shard_map."""
    def run(x_TD, residual_TD, weight_D):
        return add_rms_norm(x_TD, residual_TD, weight_D, eps, impl="kernel",
                            interpret=jax.default_backend() != "gpu")

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or parallel.TP_AXIS not in mesh.axis_names or mesh.shape[parallel.TP_AXIS] <= 1:
        return run(x_TD, residual_TD, weight_D)
    rep = PartitionSpec()
    return parallel.shard_map(run, mesh, in_specs=(rep, rep, rep), out_specs=(rep, rep))(x_TD, residual_TD, weight_D)
