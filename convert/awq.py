"""AWQ (Lin et al., 2023) for lmjax's w4 layout: activation-aware per-input-channel scales, folded into
the model, then round to nearest with least-squares scales and offsets. Same layout as
`lmjax.layers.quant.quantize_w4` (uint4 codes, a scale and an offset per group of G input rows and
output column), so the kernel and `QuantLinear` read the result unchanged.

Scaling. y = x W = (x / s) (diag(s) W) for any positive per-input-channel s. Quantizing diag(s) W
instead of W gives the input rows that carry large activations more resolution inside their group.
s = mean|x|^alpha over the calibration tokens, alpha searched on ALPHA_GRID per layer group (the
Linears reading one input) minimizing the group's output error after round to nearest; 1/s is folded
into the op that produced x, so the float model computes the same function:

  q/k/v    x = input_layernorm(h)            1/s into input_layernorm.weight
  o        x = attention(v)                  1/s into v_proj's output columns (GQA: q head n reads kv
                                             head n // (N/K), so the heads of a group share one s)
  gate/up  x = post_attention_layernorm(h)   1/s into post_attention_layernorm.weight
  down     x = silu(gate) * up               1/s into up_proj's output columns

Codes. Round to nearest (min/max of each group onto 0..15), then the scales and offsets that minimize
the output error with those codes fixed (`convert.gptq.refine_group_params`, closed form).

Measured on SmolLM2-135M, w4 g128, perplexity on tests/convert/data/perplexity.txt (float32 10.64) and,
as a check against tuning to that one text, on 1075 tokens of Python's pydoc topics (float32 9.42);
calibration: lmjax/calibration_text.py; conversion time of the calibrated ones on 2 CPU cores:
  round to nearest                          36.65   14.60
  GPTQ (least-squares group parameters)     21.51   11.73   48 s
  round to nearest + least squares          21.87
  these scales + round to nearest           23.28
  these scales + GPTQ                       17.49   11.16   (18.83 with an alpha search that differed
                                                             only in numerical details)
  these scales + least squares (default)    18.31   11.20   40 s   (18.49, 18.57 likewise)
(the default re-measured 2026-11-23 after the alpha search was switched to the stored quantizer,
`quantize_w4` / `dequantize_w4`: 18.3067 as before, since edge-padding a short last group, as the
search's own copy did, leaves its min and max unchanged.)
The last two are within the noise of these figures; the default is the cheaper one, and the one with
fewer degrees of freedom fit to ~1500 calibration tokens: GPTQ's per-weight updates reach a 1.7-3x lower
layer output error on the calibration text than round to nearest + least squares, without a better
perplexity elsewhere. Re-rounding with the fitted parameters and fitting again was not monotone (after
2, 3, 5 rounds: 17.67, 18.12, 21.30) and is left out.

Shape letters: I input dim, O output dim, A alphas, G group size.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from convert.gptq import refine_group_params, round_to
from lmjax.layers.quant import dequantize_w4, quantize_w4, unpack_w4

ALPHA_GRID = tuple(k / 20 for k in range(20))  # AutoAWQ's grid


def channel_scales(mean_abs_I, alpha):
    """mean|x|^alpha normalized to geometric mean 1 (a never-active channel counts as 1e-4 of the
    largest, so its 1/s stays finite)."""
    log_m = jnp.log(jnp.maximum(mean_abs_I, 1e-4 * jnp.max(mean_abs_I)))
    return jnp.exp(alpha * (log_m - jnp.mean(log_m)))


@functools.partial(jax.jit, static_argnames="group_size")
def scaled_rtn_errors(w_IO, h_II, mean_abs_I, alphas_A, group_size: int):
    """[A]: the output error tr(dW^T H dW) of round to nearest after each alpha's scaling,
    dW = W - Q(diag(s) W) / s, H = X^T X of the calibration inputs. Q is the stored quantizer itself
    (`quantize_w4` then `dequantize_w4`, a short last group included), so the search scores the codes
    `rtn_ls_w4` will keep; the alphas run one at a time (lax.map): vmap measured 1.6-2x slower on CPU."""
    def one(alpha):
        s_I1 = channel_scales(mean_abs_I, alpha)[:, None]
        q_IO = dequantize_w4(*quantize_w4(w_IO * s_I1, group_size), group_size, jnp.float32)
        d_IO = w_IO - q_IO / s_I1
        return jnp.sum(jnp.matmul(h_II, d_IO, precision=jax.lax.Precision.HIGHEST) * d_IO)
    return jax.lax.map(one, alphas_A)


def search_scale(w_IO, h_II, mean_abs_I, group_size: int, grid=ALPHA_GRID) -> tuple[np.ndarray, float]:
    """(s [I], alpha) minimizing `scaled_rtn_errors` over `grid`; w_IO: the kernels reading this input,
    side by side."""
    m = jnp.asarray(mean_abs_I, jnp.float32)
    errors = scaled_rtn_errors(jnp.asarray(w_IO, jnp.float32), jnp.asarray(h_II, jnp.float32), m,
                               jnp.asarray(grid, jnp.float32), group_size)
    alpha = float(grid[int(np.argmin(np.asarray(errors)))])
    return np.asarray(channel_scales(m, alpha), np.float64), alpha


def fold_layer(layer, taps: dict, group_size: int, grid=ALPHA_GRID) -> dict:
    """Search AWQ scales for one Llama-family decoder layer and fold them in, in place (float weights).
    taps: {Linear name: tap} (`convert.calibrate.HessianTap`: .linear, .xtx = X^T X, .abs_sum and
    .count); each tap's xtx becomes that of the new inputs x / s. Returns {group: alpha}."""
    cfg = layer.self_attn.cfg
    K, group, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim

    def scale_norm(norm, r):
        norm.weight[...] = norm.weight[...] * jnp.asarray(r, norm.weight.dtype)

    def scale_columns(linear, r):
        linear.kernel[...] = linear.kernel[...] * jnp.asarray(r, linear.kernel.dtype)[None, :]
        if linear.bias is not None:
            linear.bias[...] = linear.bias[...] * jnp.asarray(r, linear.bias.dtype)

    def tie_heads(m_I):  # o_proj's inputs [N * H]: one value per (kv head, channel), repeated per q head
        return np.repeat(m_I.reshape(K, group, H).mean(axis=1), group, axis=0).reshape(-1)

    def untie_heads(r_I):  # -> v_proj's output columns [K * H]
        return r_I.reshape(K, group, H)[:, 0].reshape(-1)

    plan = (  # (group, the Linears reading one input, fold 1/s into that input's producer, tie heads)
        ("qkv", ("q_proj", "k_proj", "v_proj"), lambda r: scale_norm(layer.input_layernorm, r), False),
        ("o", ("o_proj",), lambda r: scale_columns(taps["v_proj"].linear, untie_heads(r)), True),
        ("gate_up", ("gate_proj", "up_proj"), lambda r: scale_norm(layer.post_attention_layernorm, r), False),
        ("down", ("down_proj",), lambda r: scale_columns(taps["up_proj"].linear, r), False),
    )
    alphas = {}
    for name, linears, fold, tie in plan:
        tap = taps[linears[0]]
        m = np.asarray(tap.abs_sum[...], np.float64) / max(float(tap.count[...]), 1.0)
        w = np.concatenate([np.asarray(taps[n].linear.kernel[...], np.float32) for n in linears], axis=1)
        s, alphas[name] = search_scale(w, tap.xtx[...], tie_heads(m) if tie else m, group_size, grid)
        fold(1.0 / s)
        for n in linears:
            lin, t = taps[n].linear, taps[n]
            lin.kernel[...] = jnp.asarray(np.asarray(lin.kernel[...], np.float64) * s[:, None], lin.kernel.dtype)
            t.xtx[...] = jnp.asarray(np.asarray(t.xtx[...], np.float64) / np.outer(s, s), t.xtx.dtype)
    return alphas


def rtn_ls_w4(w_IO, h_II, group_size: int, *, damp: float, param_dtype=np.float32):
    """Round to nearest, then least-squares scales and offsets for those codes under the output error
    with H = X^T X dampened by `damp` x its mean diagonal (as GPTQ's). Returns what `quantize_w4` does."""
    packed, scale, offset = (np.asarray(a) for a in quantize_w4(jnp.asarray(w_IO, jnp.float32), group_size))
    H = np.asarray(h_II, np.float64).copy()
    H[np.diag_indices_from(H)] += damp * np.mean(np.diag(H))
    scale, offset = refine_group_params(w_IO, H, unpack_w4(packed), group_size, scale, offset)
    return packed, round_to(scale, param_dtype).astype(np.float32), round_to(offset, param_dtype).astype(np.float32)
