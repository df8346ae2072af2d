"""JAX's persistent compilation cache for lmjax: a second start of the engine on the same model and
settings loads every step executable from disk instead of compiling it.

`enable_compilation_cache()` is called when an engine is built. It points `jax_compilation_cache_dir`
at `~/.cache/lmjax/jax` (or `$LMJAX_COMPILATION_CACHE_DIR`; set that to "" or "0" to turn the cache
off) and lowers JAX's thresholds to zero, so that every executable is written, not only the ones that
took over a second to compile (JAX's default): the engine's many small bucket compilations add up.
A cache directory the user configured in `jax.config` (or JAX_COMPILATION_CACHE_DIR) is left alone.

What still happens on a cached start: Python tracing and lowering of each step (the engine's
`runner.num_compilations` counts traces, so it does not drop to 0); the XLA compilation is skipped
(`compile_stats()` counts JAX's cache hits and misses, read from jax.monitoring events).
"""
from __future__ import annotations

import logging
import os
import threading

import jax

logger = logging.getLogger("lmjax.engine")

ENV_VAR = "LMJAX_COMPILATION_CACHE_DIR"
DEFAULT_DIR = os.path.join("~", ".cache", "lmjax", "jax")
_DISABLED = ("", "0")

_lock = threading.Lock()
_counts = {"requests": 0, "hits": 0}
_listening = False


def cache_dir_setting() -> str | None:
    """The directory lmjax would use: $LMJAX_COMPILATION_CACHE_DIR, else the default; None when disabled."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return os.path.expanduser(DEFAULT_DIR)
    return None if value.strip() in _DISABLED else os.path.expanduser(value)


def enable_compilation_cache() -> str | None:
    """Turn on the persistent cache (idempotent); returns the directory in use, or None when off."""
    _listen()
    configured = jax.config.jax_compilation_cache_dir
    if configured:  # the user's own choice (jax.config or JAX_COMPILATION_CACHE_DIR): keep it
        return configured
    path = cache_dir_setting()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # e.g. a read-only home: run uncached rather than fail
        logger.warning("compilation cache disabled: cannot create %s (%s)", path, e)
        return None
    # Cache everything: JAX's defaults skip executables that compiled in under 1 s, and -1 (not 0)
    # stops JAX from raising the minimum entry size for some filesystems.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", path)
    logger.info("persistent compilation cache: %s", path)
    return path


def _listen() -> None:
    """Count JAX's persistent-cache lookups once per process (listeners cannot be unregistered)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            _counts["requests"] += 1
        elif event == "/jax/compilation_cache/cache_hits":
            _counts["hits"] += 1

    monitoring.register_event_listener(on_event)


def compile_stats() -> dict:
    """Persistent-cache lookups since the cache was first enabled in this process: `hits` were loaded
    from disk, `misses` were compiled by XLA (and written)."""
    requests, hits = _counts["requests"], _counts["hits"]
    return {"cache_dir": jax.config.jax_compilation_cache_dir or None, "cache_requests": requests,
            "cache_hits": hits, "cache_misses": requests - hits}
