"""The LMJAX_* switches: engine choices and numbers read from the environment at trace time, so A/B runs of one
engine (benchmarks, parity checks) need no code change. One reader, so every bad value is named alike."""
from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str, value: str | None = None,
               *, label: str | None = None) -> str:
    """`value` if given, else $`name` if set and non-empty, else `default`; it must be in `choices`.
    `label` names the argument `value` stands for (e.g. "norm impl") in the error."""
    value = value or os.environ.get(name) or default
    if value not in choices:
        where = f"{name} / {label}" if label else name
        raise ValueError(f"{where}={value!r} must be one of {choices}")
    return value


def env_int(name: str, default: int, value: int | None = None, *, minimum: int | None = None,
            label: str | None = None) -> int:
    """`value` if given, else $`name` if set and non-empty, else `default`; an integer >= `minimum`.
    `label` names the argument `value` stands for in the error, as in `env_choice`."""
    where = f"{name} / {label}" if label else name
    raw = value if value is not None else (os.environ.get(name) or default)
    try:
        number = int(str(raw).strip())  # through str: 2.5 is refused, not truncated
    except ValueError:
        raise ValueError(f"{where}={raw!r} must be an integer") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{where}={number} must be >= {minimum}")
    return number


# Batch-1 decode under tensor parallelism is a chain of 2 small all-reduces a layer (one hidden row, 8 KiB
# on 8B) with nothing to overlap them with. XLA's defaults (an asynchronous one-shot all-reduce kernel on
# its own stream) pay a cross-stream wait at each; NCCL run synchronously on the compute stream measured
# 3.63-3.70 ms a step against 3.95-3.99 (2 x H200, 8B shape, tp_decode, 2026-11-23; tp=1: 4.42-4.48).
# XLA reads these only from XLA_FLAGS when its backend starts (per-jit compiler_options are accepted but
# leave the all-reduce as it was), so they go into the environment on `import lmjax`. They change only
# multi-device all-reduces.
TP_ALLREDUCE_CHOICES = ("nccl", "xla")
NCCL_SYNC_XLA_FLAGS = ("--xla_gpu_disable_async_collectives=ALLREDUCE",
                       "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false")


def apply_xla_flag_defaults(cuda: bool | None = None) -> list[str]:
    """Add NCCL_SYNC_XLA_FLAGS to XLA_FLAGS when JAX has its CUDA plugin (`cuda`, found by default),
    unless LMJAX_TP_ALLREDUCE=xla or XLA_FLAGS already sets either option; returns the flags added.
    Not on CPU-only installs: an XLA flag a jaxlib does not know aborts the process, so they go only
    where they do something. Without effect once a JAX backend has started (set XLA_FLAGS then)."""
    if env_choice("LMJAX_TP_ALLREDUCE", TP_ALLREDUCE_CHOICES, "nccl", label="tp allreduce") == "xla":
        return []
    current = os.environ.get("XLA_FLAGS", "")
    if not (has_cuda_plugin() if cuda is None else cuda) or any(f.split("=")[0] in current for f in NCCL_SYNC_XLA_FLAGS):
        return []
    os.environ["XLA_FLAGS"] = " ".join([current, *NCCL_SYNC_XLA_FLAGS]).strip()
    return list(NCCL_SYNC_XLA_FLAGS)


def has_cuda_plugin() -> bool:
    """Whether JAX's CUDA PJRT plugin is installed (jax_plugins.xla_cuda12 / xla_cuda13), without
    importing jax or starting a backend."""
    import importlib.util

    spec = importlib.util.find_spec("jax_plugins")
    dirs = spec.submodule_search_locations if spec is not None else None
    return any(name.startswith("xla_cuda") for d in (dirs or ()) if os.path.isdir(d) for name in os.listdir(d))
