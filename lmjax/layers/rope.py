"""RoPE for the model: per-token frequencies (dynamic NTK needs each token's sequence length) applied to
q and k through pallas_kernels.rope, plus Qwen's logN query scaling past the trained context."""
import jax
import jax.numpy as jnp

from pallas_kernels.rope import RopeSpec, apply_rope_reference, inv_freq_TF


def apply_rope(q_TNH, k_TKH, positions_T, seq_lens_T, spec: RopeSpec):
    """Rotate q and k. `seq_lens_T` is the current length of each token's sequence (used by dynamic NTK)."""
    inv_freq = inv_freq_TF(spec, seq_lens_T)
    q_TNH = apply_rope_reference(q_TNH, positions_T, inv_freq, spec.attention_scaling)
    k_TKH = apply_rope_reference(k_TKH, positions_T, inv_freq, spec.attention_scaling)
    return q_TNH, k_TKH


def logn_scale_T(positions_T: jax.Array, train_len: int) -> jax.Array:
    """Qwen's logN attention scaling: log_{train_len}(pos + 1) once pos + 1 exceeds the trained length."""
    n_T = (positions_T + 1).astype(jnp.float32)
    return jnp.where(n_T > train_len, jnp.log(n_T) / jnp.log(float(train_len)), 1.0)
