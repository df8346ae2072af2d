"""Calibrated w4 quantization over a model, one decoder layer at a time: AWQ (convert.awq, the default
of `lmjax convert --quant w4`) or GPTQ (convert.gptq).

Data flow of `calibrate_w4`:
  calibration text -> token ids, cut into sequences of `seq_len` -> embeddings x [T, D] (one ragged batch)
  -> per decoder layer: every Linear wrapped in a tap that sums X^T X and |X| of its inputs; the float
     layer runs once over x
  -> awq: per-input-channel scales searched and folded into the float layer (its function unchanged),
     the taps' X^T X rescaled to the scaled inputs (convert.awq.fold_layer)
  -> each Linear quantized from its X^T X into a w4 `QuantLinear` (same layout as round-to-nearest, so
     restore and the engine do not care how it was made): awq rounds to nearest and fits scales and
     offsets by least squares; gptq runs GPTQ
  -> the *quantized* layer runs over x to give the next layer's input, so later layers calibrate on the
     errors they will see.
Two passes of each layer in all (eager, on whatever device holds the model: CPU when converting).

The lm_head stays float as in `quantize_model` (lmjax.layers.quant.SKIPPED).
Shape letters: T calibration tokens, D hidden, I a Linear's input dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.awq import fold_layer, rtn_ls_w4
from lmjax.calibration_text import DEFAULT_CALIBRATION_TEXT
from convert.gptq import gptq_w4
from lmjax.layers.attention import contiguous_metadata
from lmjax.layers.quant import QuantLinear, QuantSpec, linear_slots, quantize_lm_head, set_slot

METHODS = ("awq", "gptq")
CALIBRATION_SEQ_LEN = 512
# Dampening of X^T X (fraction of its mean diagonal) for GPTQ and for the least-squares group
# parameters. GPTQ's paper uses 0.01 with 128 x 2048 tokens; with ~1500 tokens H is far noisier, and on
# SmolLM2 0.1 measured better on the (separate) perplexity text: 28.3 vs 33.7 (GPTQ without refinement).
DAMP = 0.1
_MIN_SEQ = 16  # a shorter tail of the text adds noise, not information


def calibration_prompts(tokenizer, text: str | None = None, seq_len: int = CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """Token ids of `text` (default: lmjax.calibration_text) in sequences of at most `seq_len`."""
    ids = tokenizer.encode(text if text is not None else DEFAULT_CALIBRATION_TEXT)
    prompts = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    prompts = [p for p in prompts if len(p) >= _MIN_SEQ]
    if not prompts:
        raise ValueError(f"calibration text of {len(ids)} tokens is too short: at least {_MIN_SEQ} needed")
    return prompts


class HessianTap(nnx.Module):
    """Stands in for a Linear during calibration: same output; sums X^T X [I, I] and |X| [I] of its
    inputs over the `count` tokens seen."""

    def __init__(self, linear: nnx.Module):
        self.linear = linear
        I = linear.kernel.shape[0]
        self.xtx = nnx.Variable(jnp.zeros((I, I), jnp.float32))
        self.abs_sum = nnx.Variable(jnp.zeros((I,), jnp.float32))
        self.count = nnx.Variable(jnp.zeros((), jnp.float32))

    def __call__(self, x_TI):
        x = x_TI.astype(jnp.float32).reshape(-1, x_TI.shape[-1])
        self.xtx[...] = self.xtx[...] + jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)
        self.abs_sum[...] = self.abs_sum[...] + jnp.abs(x).sum(axis=0)
        self.count[...] = self.count[...] + x.shape[0]
        return self.linear(x_TI)


def calibrate_w4(model: nnx.Module, spec: QuantSpec, prompts: list[list[int]], *, method: str = "awq",
                 damp: float = DAMP, param_dtype=None) -> nnx.Module:
    """Swap every Linear (lm_head excepted) for a calibrated w4 QuantLinear, in place (awq also rescales
    the float norms and v/up columns it folds its scales into); the lm_head as `spec.lm_head` says.

    method: "awq" or "gptq" (see the module docstring); damp: dampening of X^T X (DAMP); param_dtype:
    the dtype scales and offsets will be stored in (default: the model's)."""
    if spec.method != "w4":
        raise ValueError(f"calibrated quantization is for w4; got method={spec.method!r} (w8 rounds to nearest)")
    if method not in METHODS:
        raise ValueError(f"calibration method={method!r} is not supported; choose one of {METHODS}")
    for layer, taps in tapped_layers(model, prompts):
        if method == "awq":
            fold_layer(layer, taps_by_name(taps), spec.group_size)
        for parent, key, tap in taps:
            set_slot(parent, key, _quantized_linear(tap, spec, method, damp, param_dtype))
    return quantize_lm_head(model, spec)  # spec.lm_head: rounded to nearest, as quantize_model does


def tapped_layers(model, prompts: list[list[int]]):
    """Yields (decoder layer, [(parent, key, tap)]) once its float pass over this layer's input has
    filled the taps; the caller puts Linears back in the taps' slots, then the layer runs again to
    give the next layer's input. (Public for tests/convert/test_quant.py's fold-only AWQ check.)"""
    run_layer, x_TD = _layer_runner(model, prompts)
    for layer in model.layers:
        taps = _install_taps(layer)
        run_layer(layer, x_TD)
        yield layer, taps
        x_TD = run_layer(layer, x_TD)


def taps_by_name(taps: list[tuple[object, object, HessianTap]]) -> dict[str, HessianTap]:
    """{Linear attribute name ("q_proj", ...): tap}, the form `convert.awq.fold_layer` reads."""
    return {str(key): tap for _, key, tap in taps}


def _layer_runner(model, prompts: list[list[int]]):
    """(run(layer, x) -> layer output, embeddings of the prompts): each decoder layer attends within
    its own sequence through a fresh paged cache, as in `lmjax.models.forward.prompt_logits`."""
    cfg, block_size = model.config, 16
    lengths = [len(p) for p in prompts]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths)
    meta = contiguous_metadata(lengths, block_size, num_blocks)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    x_TD = model.embed_tokens(jnp.asarray(np.concatenate(prompts), jnp.int32))
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    @nnx.jit  # every layer has the same structure (taps or not): one compilation for each kind
    def run(layer, x_TD):
        cache = (jnp.zeros(shape, x_TD.dtype), jnp.zeros(shape, x_TD.dtype))
        mlp_TD, residual_TD, _ = layer(x_TD, None, positions_T, cache, meta)
        return mlp_TD + residual_TD  # the layer's whole output hidden state
    return run, x_TD


def _install_taps(layer) -> list[tuple[object, object, HessianTap]]:
    taps = []
    for parent, key, linear in list(linear_slots(layer)):
        tap = HessianTap(linear)
        set_slot(parent, key, tap)
        taps.append((parent, key, tap))
    return taps


def _quantized_linear(tap: HessianTap, spec: QuantSpec, method: str, damp: float, param_dtype) -> QuantLinear:
    linear = tap.linear
    w_IO = np.asarray(linear.kernel[...], np.float32)
    dtype = param_dtype or linear.kernel.dtype
    h_II = np.asarray(tap.xtx[...])
    if method == "awq":
        packed, scale, offset = rtn_ls_w4(w_IO, h_II, spec.group_size, damp=damp, param_dtype=dtype)
    else:
        packed, scale, offset = gptq_w4(w_IO, h_II, spec.group_size, damp=damp, param_dtype=dtype)
    bias = None if linear.bias is None else linear.bias[...]
    return QuantLinear.from_arrays(spec, packed, scale, offset, bias=bias, dtype=dtype)
