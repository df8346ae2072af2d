"""Calibrated w4 quantization: GPTQ (convert.gptq) over a model, one decoder layer at a time.

Data flow of `gptq_quantize_model`:
  calibration text -> token ids, cut into sequences of `seq_len` -> embeddings x [T, D] (one ragged batch)
  -> per decoder layer: every Linear wrapped in a tap that sums X^T X of its inputs; the float layer runs
     once over x -> each Linear GPTQ-quantized from its X^T X into a w4 `QuantLinear` (same layout as
     round-to-nearest, so restore and the engine do not care how it was made) -> the *quantized* layer
     runs over x to give the next layer's input, so later layers calibrate on the errors they will see.
Two passes of each layer in all (eager, on whatever device holds the model: CPU when converting).

The lm_head stays float as in `quantize_model` (lmjax.layers.quant.SKIPPED).
Shape letters: T calibration tokens, D hidden, I a Linear's input dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.calibration_text import DEFAULT_CALIBRATION_TEXT
from convert.gptq import gptq_w4
from lmjax.layers.attention import contiguous_metadata
from lmjax.layers.quant import QuantLinear, QuantSpec, linear_slots, set_slot

CALIBRATION_SEQ_LEN = 512
# GPTQ's paper uses 0.01 with 128 x 2048 tokens; with ~1500 tokens H is far noisier, and on SmolLM2
# 0.1 measured better on the (separate) perplexity text: 28.3 vs 33.7 (without refinement).
DAMP = 0.1
_MIN_SEQ = 16  # a shorter tail of the text adds noise, not information


def calibration_prompts(tokenizer, text: str | None = None, seq_len: int = CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """Token ids of `text` (default: convert.calibration_text) in sequences of at most `seq_len`."""
    ids = tokenizer.encode(text if text is not None else DEFAULT_CALIBRATION_TEXT)
    prompts = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    prompts = [p for p in prompts if len(p) >= _MIN_SEQ]
    if not prompts:
        raise ValueError(f"calibration text of {len(ids)} tokens is too short: at least {_MIN_SEQ} needed")
    return prompts


class HessianTap(nnx.Module):
    """Stands in for a Linear during calibration: same output, and sums X^T X [I, I] of its inputs."""

    def __init__(self, linear: nnx.Module):
        self.linear = linear
        I = linear.kernel.shape[0]
        self.xtx = nnx.Variable(jnp.zeros((I, I), jnp.float32))

    def __call__(self, x_TI):
        x = x_TI.astype(jnp.float32)
        self.xtx[...] = self.xtx[...] + jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)
        return self.linear(x_TI)


def gptq_quantize_model(model: nnx.Module, spec: QuantSpec, prompts: list[list[int]], *, damp: float = DAMP,
                        refine: bool = True, param_dtype=None) -> nnx.Module:
    """Swap every Linear (lm_head excepted) for a GPTQ-quantized w4 QuantLinear, in place.

    damp: GPTQ's dampening of the Hessian (fraction of its mean diagonal); refine: least-squares
    scales and offsets once the codes are chosen (convert.gptq.refine_group_params); param_dtype:
    the dtype scales and offsets will be stored in (default: the model's)."""
    if spec.method != "w4":
        raise ValueError(f"calibrated quantization is for w4; got method={spec.method!r} (w8 rounds to nearest)")
    run_layer, x_TD = _layer_runner(model, prompts)
    for layer in model.layers:
        taps = _install_taps(layer)
        run_layer(layer, x_TD)
        for parent, key, tap in taps:
            set_slot(parent, key, _gptq_linear(tap, spec, damp, refine, param_dtype))
        x_TD = run_layer(layer, x_TD)
    return model


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


def _gptq_linear(tap: HessianTap, spec: QuantSpec, damp: float, refine: bool, param_dtype) -> QuantLinear:
    linear = tap.linear
    w_IO = linear.kernel[...]
    dtype = param_dtype or w_IO.dtype
    packed, scale, offset = gptq_w4(np.asarray(w_IO, np.float32), np.asarray(tap.xtx[...]), spec.group_size,
                                    damp=damp, param_dtype=dtype, refine=refine)
    bias = None if linear.bias is None else linear.bias[...]
    return QuantLinear.from_arrays(spec, packed, scale, offset, bias=bias, dtype=dtype)
