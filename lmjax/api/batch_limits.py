"""vLLM's LLM-class batch limits, max_num_seqs and max_num_batched_tokens: their defaults by device, their
checks."""
from __future__ import annotations

import os

import jax

from lmjax import parallel
from lmjax.api.batch import is_token_id


def batch_limits(max_num_seqs, max_num_batched_tokens, defaults: tuple[int, int]) -> tuple[int, int]:
    """vLLM's max_num_seqs and max_num_batched_tokens (None: `defaults`, batch_defaults()'s), checked as vLLM
    does, but for one thing: a budget given alone may be below the default max_num_seqs (vLLM raises; lmjax's steps then
    schedule at most that many tokens, decode tokens included, as vLLM's budget counts them)."""
    default_seqs, default_tokens = defaults
    tokens = default_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = default_seqs if max_num_seqs is None else max_num_seqs
    for name, value in (("max_num_seqs", seqs), ("max_num_batched_tokens", tokens)):
        if not is_token_id(value) or value < 1:  # (an int, not a bool)
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if tokens < seqs and max_num_seqs is not None:
        raise ValueError(f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs ({seqs})")
    return seqs, tokens


def batch_defaults(device=None) -> tuple[int, int]:
    """vLLM's LLM-class defaults for (max_num_seqs, max_num_batched_tokens): larger on big GPUs, where a
    wider decode batch turns bandwidth-bound steps into better-utilised matmuls (vLLM's arg_utils
    picks 1024 / 16384 for devices with >= 70 GiB except A100s, measured slower there by vLLM)."""
    parallel.initialize_distributed()  # first: a process joins the others before JAX's backend starts
    device = device or jax.local_devices()[0]
    stats = (device.memory_stats() if device.platform == "gpu" else None) or {}
    # XLA's limit is a fraction of the device's memory (0.75 unless XLA_PYTHON_CLIENT_MEM_FRACTION says)
    total_bytes = stats.get("bytes_limit", 0) / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    if total_bytes >= 70 * 2**30 and "a100" not in device.device_kind.lower():
        return 1024, 16384
    return 256, 8192
