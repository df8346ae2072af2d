"""One layer from several that read the same input: their output columns side by side.

Why: a batch-1 decode step is launch-bound. q/k/v (and gate/up) read the same activations; one weight
means one GEMM launch and one output buffer that a fused consumer (the RoPE + KV-write kernel) can read
whole. XLA merges q/k/v dots by itself but then copies the pieces apart for a custom call, and it leaves
gate and up as two GEMMs (H200 profile, 2026-11-23, BENCHMARKS.md).

Float `Linear`s merge, and so do `QuantLinear`s of one QuantSpec (w8: int8 kernel [I, O] and scale [O];
w4: packed kernel [I/2, O], scale and offset [G, O]: every array is split by output column, so the
columns concatenate). Only on one device: tensor parallelism shards each projection's columns, and a
merged weight's shards would mix q, k and v.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lmjax.layers.linear import Linear
from lmjax.layers.quant import QuantLinear

_ARRAYS = ("kernel", "scale", "offset", "bias")  # every per-output-column array a linear layer may hold


def mergeable(layers) -> bool:
    """Same class (Linear or QuantLinear), same dtype, same QuantSpec, all with or all without bias."""
    first = layers[0]
    if type(first) not in (Linear, QuantLinear) or any(type(x) is not type(first) for x in layers):
        return False
    if any((x.bias is None) != (first.bias is None) or x.kernel[...].dtype != first.kernel[...].dtype
           for x in layers):
        return False
    return not isinstance(first, QuantLinear) or all(x.spec == first.spec for x in layers)


def merge_linears(layers):
    """One layer whose output is the layers' outputs concatenated, in order; None when not `mergeable`."""
    if not mergeable(layers):
        return None
    merged = nnx.eval_shape(lambda: _empty_like(layers[0]))
    for name in _ARRAYS:
        if getattr(layers[0], name, None) is not None:
            setattr(merged, name, nnx.Param(jnp.concatenate([getattr(x, name)[...] for x in layers], axis=-1)))
    return merged


def _empty_like(layer):
    """A layer of `layer`'s kind and settings (arrays replaced by merge_linears)."""
    in_dim = layer.kernel.shape[0]
    if isinstance(layer, QuantLinear):
        in_dim *= 2 if layer.spec.method == "w4" else 1
        return QuantLinear(in_dim, 1, layer.spec, bias=layer.bias is not None, dtype=layer.dtype)
    return Linear(in_dim, 1, bias=layer.bias is not None, dtype=layer.kernel.dtype)
