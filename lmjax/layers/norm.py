"""RMSNorm as in HF Llama: statistics in float32, weight applied after casting back to the input dtype."""
import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        x32_TD = x_TD.astype(jnp.float32)
        variance_T1 = jnp.mean(x32_TD * x32_TD, axis=-1, keepdims=True)
        normed_TD = (x32_TD * jax.lax.rsqrt(variance_T1 + self.eps)).astype(x_TD.dtype)
        return self.weight[...] * normed_TD
