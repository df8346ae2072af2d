"""Read a Hugging Face checkpoint directory: config.json plus one or many *.safetensors shards.

Tensors come out one at a time as read-only numpy views of the memory-mapped shard (bf16 via ml_dtypes):
nothing is copied while reading, so the placement copies each tensor once, straight from the page cache
onto its device (or shards), and the whole model never sits in host memory.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes -> numpy dtypes (bf16 and fp8: jax's, from ml_dtypes); little-endian on disk,
# as on every host jax runs on.
_NUMPY_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
                 "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
                 "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64,
                 "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, corrupt or incomplete; the message names the file."""


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def shard_map_of(model_dir: str) -> dict[str, str]:
    """tensor name -> shard file, from the index when sharded, else from model.safetensors' header (from every
    *.safetensors file's when there is none)."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if "model.safetensors" in files:  # as transformers: beside it a Mistral consolidated.safetensors is not read
        files = ["model.safetensors"]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
    names = {}
    for file in files:
        path = os.path.join(model_dir, file)
        for name in _open(path).keys():
            names[name] = path
    return names


def _open(path: str):
    """safe_open, which validates the header (offsets inside the file, no overlaps, no holes)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e


def mapped_tensors(path: str) -> dict[str, np.ndarray]:
    """{name: read-only numpy view of the tensor in the memory-mapped file}, in file order.

    safetensors has no zero-copy numpy reader: its numpy and flax `get_tensor` copy every tensor into a
    new buffer, holding the GIL, and flax then copies it twice more (into a jax CPU array, back to
    numpy): 1.8 s of the 1B shape's 3.0 s load on a 2-core CPU, before any transfer. So safetensors
    validates the file and numpy maps it, at the offsets its header gives.
    """
    _open(path)  # validates the header; a CheckpointError names the file
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # stays open while a view lives
    if hasattr(mmap, "MADV_WILLNEED"):
        mapped.madvise(mmap.MADV_WILLNEED)  # start the kernel's readahead: a cold read overlaps the copies
    start, header = _header(mapped)
    in_file_order = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return {name: _view(mapped, start, info, name, path) for name, info in in_file_order}


def _header(mapped: mmap.mmap) -> tuple[int, dict]:
    """(offset of the data, {name: {dtype, shape, data_offsets}}): a safetensors file starts with the
    header's length (8 bytes, little-endian) and the JSON header; data offsets count from its end."""
    (length,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8:8 + length])
    header.pop("__metadata__", None)
    return 8 + length, header


def _view(mapped: mmap.mmap, start: int, info: dict, name: str, path: str) -> np.ndarray:
    dtype = _NUMPY_DTYPES.get(info["dtype"])
    if dtype is None:
        raise CheckpointError(f"tensor {name!r} in {path} has dtype {info['dtype']}, which lmjax cannot load")
    return np.ndarray(info["shape"], dtype, buffer=mapped, offset=start + info["data_offsets"][0])


def iter_tensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, read-only host view) for every tensor of the checkpoint, shard by shard in file order."""
    by_file: dict[str, set[str]] = {}
    for name, path in shard_map_of(model_dir).items():
        by_file.setdefault(path, set()).add(name)
    for path, names in by_file.items():
        views = mapped_tensors(path)
        missing = sorted(names - views.keys())
        if missing:
            raise CheckpointError(f"tensor {missing[0]!r} listed in the index is missing from {path}")
        for name in [n for n in views if n in names]:
            yield name, views.pop(name)  # ours dropped: the mapping closes when the last view is placed
