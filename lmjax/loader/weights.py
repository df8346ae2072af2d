"""Fill a model's parameters from HF-named tensors: one weight map for every architecture.

HF name -> NNX path: drop the leading `model.`, split on dots (layer indices become ints); a Linear's
`weight` becomes its `kernel`, transposed from torch's [out, in] to [in, out]; an embedding's `weight`
becomes `embedding`. Tensors are converted and placed as they are read, a few at a time on worker threads
(device_put and numpy release the GIL: one tensor's copy overlaps the next one's), so host memory holds
only the tensors in flight.
"""
from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx

from lmjax.loader.phases import PhaseTimes
from lmjax.loader.safetensors_loader import CheckpointError

# Buffers some checkpoints carry that are recomputed, never loaded (ColossalAI also saves the cos / sin
# caches; vLLM and transformers skip them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
Placer = Callable[[tuple, np.ndarray], jax.Array]
# Threads placing tensors, and tensors in flight at once (each read, converted or being copied).
_PLACE_WORKERS = 2
_IN_FLIGHT = 2 * _PLACE_WORKERS


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


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _to_param(x: jax.Array, dtype: np.dtype, transpose: bool) -> jax.Array:
    """The checkpoint's tensor as the model holds it, computed on the device into a new buffer: numpy
    transposes a [out, in] matrix at ~0.4 GB/s (8 s of a 1B model's load) and casts bf16 -> f32 at
    ~1.5 GB/s on a CPU; the device (or XLA on a CPU) does both at memory speed."""
    x = x.astype(dtype)
    return x.T if transpose else x


def load_params(model_fn: Callable[[], nnx.Module], tensors: Iterable[tuple[str, np.ndarray]], dtype,
                source: str, placer: Placer = _default_placer, times: PhaseTimes | None = None) -> nnx.Module:
    """Build the model abstractly (no random init), then fill every parameter from `tensors`; `times`
    collects the seconds of each phase (build, read, convert, place, transpose, sync, merge)."""
    times = times if times is not None else PhaseTimes()
    with times.phase("build"):
        graphdef, abstract = nnx.split(nnx.eval_shape(model_fn))
        flat = dict(nnx.to_flat_state(abstract))
    filled = _place_all(_checked(tensors, flat, dtype, source, times), _placement(placer, times))
    missing = [".".join(map(str, p)) for p in flat if p not in filled]
    if missing:
        raise CheckpointError(f"{source} is missing tensors for {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    with times.phase("sync"):
        jax.block_until_ready(filled)  # transfers and transposes still in flight are part of the load
    with times.phase("merge"):
        for path, var in flat.items():
            var.set_value(filled[path]) if hasattr(var, "set_value") else setattr(var, "value", filled[path])
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _checked(tensors: Iterable[tuple[str, np.ndarray]], flat: dict, dtype, source: str,
             times: PhaseTimes) -> Iterator[tuple[tuple, np.ndarray, np.dtype, bool]]:
    """(NNX path, host array, its dtype in the model, transpose?) per tensor, checked against the model."""
    tensors = iter(tensors)
    # A tied checkpoint (tie_word_embeddings) may store lm_head.weight as well; transformers ties the head to
    # the embedding and never reads it, so its model has no place for it here either.
    tied = not any(p[:1] == ("lm_head",) for p in flat)
    while True:
        with times.phase("read"):
            item = next(tensors, None)
        if item is None:
            return
        name, array = item
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        path, transpose = _target(name, flat)
        expected = tuple(flat[path].shape)
        if (array.shape[::-1] if transpose else array.shape) != expected:
            raise CheckpointError(f"tensor {name!r} in {source} has shape {array.shape}; the model expects "
                                  f"{expected if not transpose else expected[::-1]}")
        # Quantized kernels (AWQ import) keep their integer dtype; float tensors take the model's.
        target = dtype if np.issubdtype(np.dtype(flat[path].dtype), np.floating) else flat[path].dtype
        yield path, array, np.dtype(target), transpose


def _placement(placer: Placer, times: PhaseTimes) -> Callable[[tuple, np.ndarray, np.dtype, bool], jax.Array]:
    """place(path, host, dtype, transpose): one tensor converted and on its device(s)."""
    # A CPU device buffer aliases the numpy memory it is given when it can (measured, jax 0.10: even
    # device_put(..., may_alias=False)), and a placer may keep what it gets: parameters must not live in
    # the mapped checkpoint file, which someone may overwrite. An accelerator copies anyway.
    detach = placer is not _default_placer or jax.local_devices()[0].platform == "cpu"

    def place(path: tuple, array: np.ndarray, dtype: np.dtype, transpose: bool) -> jax.Array:
        if placer is _default_placer and (transpose or array.dtype != dtype):
            with times.phase("place"):
                on_device = placer(path, np.ascontiguousarray(array))  # in the checkpoint's dtype
            with times.phase("transpose"):  # and cast
                return _to_param(on_device, dtype=dtype, transpose=transpose)
        with times.phase("convert"):  # on the host: a placer receives the parameter as the model holds it
            host = array.astype(dtype, copy=False)  # no copy when the dtypes match
            host = np.ascontiguousarray(host.T if transpose else host)
            host = _detached(host) if detach else host
        with times.phase("place"):
            return placer(path, host)
    return place


def _detached(host: np.ndarray) -> np.ndarray:
    """`host`, or a copy of it when it borrows its memory (a view of the mapped checkpoint)."""
    return host if host.flags.owndata else np.array(host)


def _place_all(items: Iterable[tuple], place: Callable[..., jax.Array]) -> dict[tuple, jax.Array]:
    """{path: place(path, *rest)} over (path, *rest) items, on _PLACE_WORKERS threads with at most
    _IN_FLIGHT items submitted and not yet collected: the reader never runs far ahead of the copies."""
    filled: dict[tuple, jax.Array] = {}
    in_flight: collections.deque = collections.deque()
    with ThreadPoolExecutor(_PLACE_WORKERS, thread_name_prefix="lmjax-load") as pool:
        for item in items:
            in_flight.append((item[0], pool.submit(place, *item)))
            if len(in_flight) >= _IN_FLIGHT:
                path, future = in_flight.popleft()
                filled[path] = future.result()
        for path, future in in_flight:
            filled[path] = future.result()
    return filled
