"""Fill a model's parameters from HF-named tensors: one weight map for every architecture.

HF name -> NNX path: drop the leading `model.`, split on dots (layer indices become ints); a Linear's
`weight` becomes its `kernel`, transposed from torch's [out, in] to [in, out]; an embedding's `weight`
becomes `embedding`. Each tensor is converted and placed as it is read, so host memory holds one at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx

from lmjax.loader.safetensors_loader import CheckpointError

# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
Placer = Callable[[tuple, np.ndarray], jax.Array]


def _hf_path(name: str) -> tuple:
    parts = name.removeprefix("model.").split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def _target(name: str, params: dict) -> tuple[tuple, bool]:
    """NNX path for an HF tensor name, and whether it needs the [out, in] -> [in, out] transpose."""
    path = _hf_path(name)
    if path[-1] == "weight":
        for leaf, transpose in (("kernel", True), ("embedding", False), ("weight", False)):
            candidate = path[:-1] + (leaf,)
            if candidate in params:
                return candidate, transpose
    if path in params:
        return path, False
    raise CheckpointError(f"checkpoint tensor {name!r} has no place in the model")


def _default_placer(path: tuple, array: np.ndarray) -> jax.Array:
    # An explicit device: never whatever default-device context the caller happens to be in.
    return jax.device_put(array, jax.local_devices()[0])


_transpose = jax.jit(lambda x: x.T)


def load_params(model_fn: Callable[[], nnx.Module], tensors: Iterable[tuple[str, np.ndarray]], dtype,
                source: str, placer: Placer = _default_placer) -> nnx.Module:
    """Build the model abstractly (no random init), then fill every parameter from `tensors`."""
    graphdef, abstract = nnx.split(nnx.eval_shape(model_fn))
    flat = dict(nnx.to_flat_state(abstract))
    filled: dict[tuple, jax.Array] = {}
    for name, array in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        path, transpose = _target(name, flat)
        expected = tuple(flat[path].shape)
        if (array.shape[::-1] if transpose else array.shape) != expected:
            raise CheckpointError(f"tensor {name!r} in {source} has shape {array.shape}; the model expects "
                                  f"{expected if not transpose else expected[::-1]}")
        # Quantized kernels (AWQ import) keep their integer dtype; float tensors take the model's.
        target = dtype if np.issubdtype(np.dtype(flat[path].dtype), np.floating) else flat[path].dtype
        host = np.ascontiguousarray(array.astype(target, copy=False))
        if transpose and placer is _default_placer:
            # numpy transposes a [out, in] matrix at ~0.4 GB/s (8 s of a 1B model's load); the device
            # (or XLA on a CPU) does it at memory speed.
            filled[path] = _transpose(placer(path, host))
        else:
            filled[path] = placer(path, np.ascontiguousarray(host.T) if transpose else host)
    missing = [".".join(map(str, p)) for p in flat if p not in filled]
    if missing:
        raise CheckpointError(f"{source} is missing tensors for {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for path, var in flat.items():
        var.set_value(filled[path]) if hasattr(var, "set_value") else setattr(var, "value", filled[path])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
