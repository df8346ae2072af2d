"""Linear layer with the kernel stored [in, out] (x @ W), so HF's torch [out, in] weights are transposed
once at load time and never per step."""
import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, *, bias: bool = False, dtype=jnp.float32):
        self.kernel = nnx.Param(jnp.zeros((in_dim, out_dim), dtype))
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype)) if bias else None

    def __call__(self, x_TI: jax.Array) -> jax.Array:
        y_TO = x_TI @ self.kernel[...]
        if self.bias is not None:
            y_TO = y_TO + self.bias[...]
        return y_TO
