"""Read a Hugging Face checkpoint directory: config.json plus one or many *.safetensors shards.

Tensors come out one at a time as host numpy arrays (bf16 via ml_dtypes), so a caller can convert and
place each on its device (or shard) before the next is read: the whole model never sits twice in memory.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


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
    """tensor name -> shard file, from the index when sharded, else from the single file's header."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
    names = {}
    for file in files:
        path = os.path.join(model_dir, file)
        for name in _open(path).keys():
            names[name] = path
    return names


def _open(path: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    try:
        return safe_open(path, framework="flax", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e


def iter_tensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host array) for every tensor of the checkpoint, shard by shard."""
    by_file: dict[str, list[str]] = {}
    for name, path in shard_map_of(model_dir).items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name!r} listed in the index is missing from {path}")
                yield name, _read(f, name, path)


def _read(f, name: str, path: str) -> np.ndarray:
    # The CPU default device must not stay set across `yield`: a generator's `with` stays active while
    # it is suspended, and the caller would then place its arrays on the host (measured: a GPU engine
    # copying all weights to the device every step).
    cpu = jax.local_devices(backend="cpu")[0]  # this process's own (multi-process: devices()[0] may not be)
    with jax.default_device(cpu):
        try:
            return np.asarray(f.get_tensor(name))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {e}") from e
