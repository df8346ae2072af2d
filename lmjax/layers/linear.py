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


def silu_and_mul(gate_up_TO: jax.Array) -> jax.Array:
    """silu(gate) * up of a merged gate/up projection's output ([gate | up] columns) -> [T, O/2] (vLLM's SiluAndMul)."""
    gate_TP, up_TP = jnp.split(gate_up_TO, 2, axis=-1)
    return jax.nn.silu(gate_TP) * up_TP
