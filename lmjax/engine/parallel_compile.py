"""Warm-up's compilations on several threads at once.

Warm-up compiles tens of whole-model programs (one per decode batch bucket and block-table width: 81 for the 1B
shape with vLLM's GPU defaults, ~4 minutes one after another on an H100 with an empty compilation cache). Tracing
and lowering a program holds the GIL; XLA's compilation of it does not. So warm-up first lowers every program on
the calling thread and hands each lowered one to a pool of threads to compile, while it lowers the next; then it
runs them one after another as before. jax caches a jitted function's lowering and the executable compiled from
it, so the later call with the same arguments (shapes, dtypes, shardings, static values) neither traces nor
compiles again (tests/engine/test_parallel_compile.py holds that).

LMJAX_COMPILE_THREADS: the pool's threads (default min(8, CPUs)); 1 compiles as before, one program at a time.
A compilation that fails here is only logged: the later call compiles it again and raises where it always has.

Python's cyclic garbage collector is paused while warm-up traces (`paused_gc`): tracing allocates hundreds of
thousands of objects, so full collections over the loaded engine's heap keep starting; they took 20-26% of
a decode program's trace and lowering on the CPU (SmolLM2, 2.3 s with it paused against 3.1 s for six programs).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from lmjax.env import env_int

logger = logging.getLogger("lmjax.engine")


_gc_lock = threading.Lock()
_gc_pauses = 0  # paused_gc blocks open, over all threads (two engines' threads may overlap)
_gc_was_enabled = False  # as the first of them found it


@contextlib.contextmanager
def paused_gc():
    """No cyclic garbage collection inside (reference counting still frees the rest); when the last overlapping
    pause ends (any thread), as it was before the first."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def compile_threads() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return env_int("LMJAX_COMPILE_THREADS", min(8, cpus), minimum=1)  # (the CPUs this process may run on)


class Precompiler:
    """`add(lower)`: lower now (`lower` returns a jax Lowered), compile on the pool. `wait()`: until all are
    compiled. With one thread it does nothing: the calls compile as they are made."""

    def __init__(self, threads: int | None = None):
        self.threads = compile_threads() if threads is None else threads
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmjax-precompile") \
            if self.threads > 1 else None
        self._futures: list[Future] = []
        self.lower_seconds = 0.0

    def add(self, lower: Callable[[], Any]) -> None:
        if self._pool is None:
            return
        start = time.perf_counter()
        try:
            lowered = lower()
        except Exception as e:  # noqa: BLE001  (the call traces again and raises it there)
            logger.warning("warm-up could not lower a program ahead (%r); it compiles when run", e)
            return
        self.lower_seconds += time.perf_counter() - start
        self._futures.append(self._pool.submit(lowered.compile))

    def wait(self) -> dict:
        """Block until every compilation ends; what was done, for the log."""
        start, failed = time.perf_counter(), 0
        for future in self._futures:
            error = future.exception()
            if error is not None:
                failed += 1
                logger.warning("a warm-up compilation failed on its thread (%r); it compiles again when run", error)
        if self._pool is not None:
            self._pool.shutdown()
        return {"programs": len(self._futures), "failed": failed, "threads": self.threads,
                "lower_seconds": round(self.lower_seconds, 1),
                "compile_wait_seconds": round(time.perf_counter() - start, 1)}
