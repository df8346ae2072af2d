"""One layer from several that read the same input: their output columns side by side.

Why: a batch-1 decode step is launch-bound. q/k/v (and gate/up) read the same activations; one weight
means one GEMM launch and one output buffer that a fused consumer (the RoPE + KV-write kernel) can read
whole. XLA merges q/k/v dots by itself but then copies the pieces apart for a custom call, and it leaves
gate and up as two GEMMs (H200 profile, 2026-11-23, BENCHMARKS.md).

Float `Linear`s merge, and so do `QuantLinear`s of one QuantSpec (w8: int8 kernel [I, O] and scale [O];
w4: packed kernel [I/2, O], scale and offset [G, O]: every array is split by output column, so the
columns concatenate). Under tensor parallelism each projection's columns are sharded: the merged weight
then goes shard by shard (`shards`), so each device's block is its own [q | k | v] heads.
"""
from __future__ import annotations

import jax
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


def merge_linears(layers, shards: int = 1):
    """One layer whose output is the layers' outputs concatenated, in order; None when not `mergeable`.

    shards > 1 (tensor parallelism): the columns go shard by shard, [a_0 | b_0 | a_1 | b_1 | ...] where
    a_s is the s-th of `shards` equal column blocks of layer a, so that a column-sharded merged weight
    gives each device its own [a_s | b_s]. The merged arrays keep the first layer's sharding."""
    if not mergeable(layers):
        return None
    merged = nnx.eval_shape(lambda: _empty_like(layers[0]))
    for name in _ARRAYS:
        if getattr(layers[0], name, None) is not None:
            setattr(merged, name, nnx.Param(_concat_by_shard([getattr(x, name)[...] for x in layers], shards)))
    return merged


def _concat_by_shard(arrays, shards: int):
    """Concatenate on the last axis, block by block (each array's last axis seen as [shards, -1]), placed
    as the first array is."""
    if shards == 1:
        return jnp.concatenate(arrays, axis=-1)
    blocks = [a.reshape(*a.shape[:-1], shards, a.shape[-1] // shards) for a in arrays]
    out = jnp.concatenate(blocks, axis=-1)
    return jax.device_put(out.reshape(*out.shape[:-2], -1), arrays[0].sharding)


def _empty_like(layer):
    """A layer of `layer`'s kind and settings (arrays replaced by merge_linears)."""
    in_dim = layer.kernel.shape[0]
    if isinstance(layer, QuantLinear):
        in_dim *= 2 if layer.spec.method == "w4" else 1
        return QuantLinear(in_dim, 1, layer.spec, bias=layer.bias is not None, dtype=layer.dtype)
    return Linear(in_dim, 1, bias=layer.bias is not None, dtype=layer.kernel.dtype)
