"""Sampling variants of the multi-step decode call, compiled off the critical path.

The multi-step decode call (lmjax.engine.decode_loop) has the sampler inside its device loop, so each
combination of sampling features (SamplingFlags, and the widths of ban and bias lists) is a compilation of
the whole model. Compiling one in the middle of serving stalls every running request for seconds (vLLM's
sampler runs outside its CUDA graphs and never does). So only the basic variants (greedy or plain
temperature sampling: `lmjax.layers.sampler.is_basic`) compile when first met, as warm-up does; any other
is traced, lowered and compiled on a worker thread (from the arguments' shapes and shardings: the calling
thread goes on, donating the arrays; XLA releases the GIL while it compiles). Until it is ready the engine
runs those steps one at a time: their model step is shared by every variant and their sampler is a small
program of its own (ModelRunner._run). Multi-step calls compute what single steps compute; on a GPU the two
programs round differently (as they always have: tests/engine/test_multistep.py), so where a run switches
from one to the other depends on when the worker finishes. LMJAX_BACKGROUND_COMPILE=0 compiles every
variant when first met instead (the stall, then no single steps: runs that must repeat bit for bit, tests
that count multi-step calls).

The worker holds no reference to the engine between jobs: a dropped engine's queued compilations are
cancelled (its parameters and cache freed once the one compiling ends), and at interpreter exit queued ones
are skipped.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ContextManager

import jax

from lmjax.engine.parallel_compile import paused_gc
from lmjax.env import env_choice

logger = logging.getLogger("lmjax.engine")
_exiting = threading.Event()
# Set before the interpreter joins worker threads (concurrent.futures runs their queued jobs first otherwise).
getattr(threading, "_register_atexit", lambda fn: None)(_exiting.set)


def background_compile_enabled() -> bool:
    return env_choice("LMJAX_BACKGROUND_COMPILE", ("1", "0"), "1") == "1"


def variant_key(args: Any, static: dict) -> tuple:
    """What selects a compilation of a jitted call: the arguments' structure, shapes and dtypes, and the
    static arguments (values of the arrays do not)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((x.shape, str(x.dtype)) for x in leaves), tuple(sorted(static.items()))


class BackgroundCompiler:
    """Runs a jitted call through its compiled variants, compiling new non-basic ones on a worker thread."""

    def __init__(self, jitted: Callable, enabled: bool | None = None,
                 context: Callable[[], ContextManager] = contextlib.nullcontext, name: str = "decode",
                 lower_here: bool = False):
        self.jitted = jitted
        self.name = name  # what the log calls its variants
        # Trace and lower on the calling thread, compile on the worker (the one-step call's compilers): a trace on
        # the worker shares the GIL with the engine thread for its whole length, here it stalls that thread once;
        # first-round totals measured no different either way (BENCHMARKS.md, session 29). The trace waits for
        # `lower_deferred` (the engine's next step), so the step that met the variant returns its tokens first.
        self.lower_here = lower_here
        self._deferred: dict[tuple, tuple[tuple, dict]] = {}  # variants to lower here: (abstract args, static)
        self.enabled = background_compile_enabled() if enabled is None else enabled
        self.context = context  # entered around the worker's tracing (the mesh the calling thread runs under)
        self._in_jit: set[tuple] = set()  # variants the jitted function has compiled (its own cache)
        self._compiled: dict[tuple, Any] = {}  # variants compiled here (jax.stages.Compiled)
        self._compiling: dict[tuple, Future] = {}
        self._failed: set[tuple] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.num_background = 0  # variants handed to the worker

    def __call__(self, fixed: tuple, varying: tuple, static: dict, basic: bool, now: bool = False):
        """jitted(*fixed, *varying, **static), or None when its variant is compiling in the background (or
        failed to): the caller runs something else. `fixed`: arguments whose shapes never change (the
        parameters, the cache), left out of the variant's key. `basic` or `now` (warm-up): compile now, as
        the jitted function does."""
        args = (*fixed, *varying)
        if (basic and not now) or not self.enabled:  # (the greedy decode loop's path: no key to build)
            return self.jitted(*args, **static)
        key = variant_key(varying, static)
        if now:  # warm-up records it: later calls may not be `basic`
            self._in_jit.add(key)
        if self.ready(key):
            return self.run(key, args, static)
        self.compile_later(key, args, static)
        return None

    def ready(self, key: tuple) -> bool:
        """Whether the variant `key` runs without compiling (the jitted function's or the worker's program)."""
        return key in self._in_jit or key in self._compiled or self._collect(key) is not None

    def pending(self, key: tuple) -> bool:
        """Whether `key` is with the worker, or waits to be lowered for it (or failed: it will not be ready)."""
        return key in self._compiling or key in self._failed or key in self._deferred

    def busy(self) -> bool:
        """Whether the worker has a variant in hand, or one waits to be lowered for it."""
        return bool(self._deferred) or any(not future.done() for future in self._compiling.values())

    def lower_deferred(self) -> None:
        """Trace and lower the variants handed over since the last call, here, and hand them to the worker."""
        while (key := next(iter(self._deferred), None)) is not None:  # first met, first lowered
            item = self._deferred.pop(key, None)  # (None: another thread took it, e.g. a benchmark's wait())
            if item is not None:
                self._compiling[key] = self._pool_submit(_compile_lowered, self._lower(*item), self.name)

    def failed(self, key: tuple) -> bool:
        """Whether the worker failed to compile `key` (it compiles when met instead)."""
        return key in self._failed

    def compile_later(self, key: tuple, args: tuple, static: dict) -> None:
        """Hand `key`'s variant (these arguments' shapes, dtypes and shardings) to the worker, unless it is ready
        or there already."""
        if not self.ready(key) and not self.pending(key):
            self._submit(key, jax.tree_util.tree_map(_abstract, args), static)

    def run(self, key: tuple, args: tuple, static: dict):
        """jitted(*args, **static) by the worker's program when it has one, else by the jitted function
        (compiling now if new)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return self._call_compiled(key, compiled, args, static)
        self._in_jit.add(key)
        return self.jitted(*args, **static)

    def wait(self) -> None:
        """Block until every variant handed to the worker is compiled (tests; a benchmark's warm-up)."""
        self.lower_deferred()
        for key, future in list(self._compiling.items()):
            if not future.cancelled():
                future.exception()
            self._collect(key)

    def _call_compiled(self, key: tuple, compiled, args: tuple, static: dict):
        try:
            return compiled(*args)
        except (TypeError, ValueError) as e:  # raised before running (nothing donated): arguments it was not
            logger.warning("a background-compiled %s variant refused its arguments (%s); compiling it "
                           "on the engine's thread", self.name, e)  # traced for, e.g. another sharding
            del self._compiled[key]
            self._in_jit.add(key)
            return self.jitted(*args, **static)

    def _submit(self, key: tuple, abstract_args: tuple, static: dict) -> None:
        self.num_background += 1
        if self.lower_here:
            self._deferred[key] = (abstract_args, static)
        else:
            self._compiling[key] = self._pool_submit(_compile_job, weakref.ref(self), abstract_args, static)

    def _pool_submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmjax-compile")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool.submit(fn, *args)

    def _lower(self, abstract_args: tuple, static: dict):
        """Trace and lower on the calling thread (the worker only compiles); a failure is the compilation's."""
        start = time.perf_counter()
        try:
            with self.context(), paused_gc():  # (a stall of the engine's thread: lmjax.engine.parallel_compile)
                lowered = self.jitted.lower(*abstract_args, **static)
        except Exception as e:  # noqa: BLE001  (the variant compiles when met instead)
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        logger.info("traced a %s variant in %.1f s for the background", self.name, time.perf_counter() - start)
        return lowered

    def _collect(self, key: tuple):
        future = self._compiling.get(key)
        if future is None or not future.done():
            return None
        del self._compiling[key]
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None or future.result() is None:
            self._failed.add(key)  # the engine keeps serving: single steps, or the step compiled when met
            logger.warning("background compilation of a %s variant failed (%r)", self.name, error, exc_info=error)
            return None
        self._compiled[key] = future.result()
        return self._compiled[key]


def _compile_lowered(lowered, name: str):
    if _exiting.is_set():
        return None  # skipped at interpreter exit, as _compile_job's
    if isinstance(lowered, Future):
        return lowered.result()  # raises the tracing's error: the variant is marked failed
    start = time.perf_counter()
    compiled = _compile(lowered)
    logger.info("compiled a %s variant in the background in %.1f s", name, time.perf_counter() - start)
    return compiled


def _compile_job(compiler_ref: weakref.ref, abstract_args: tuple, static: dict):
    """Trace with the compiler alive (its jitted function holds the engine), compile without it."""
    compiler = compiler_ref()
    if compiler is None or _exiting.is_set():
        return None
    name = compiler.name
    start = time.perf_counter()
    with compiler.context():
        lowered = compiler.jitted.lower(*abstract_args, **static)
    del compiler
    traced = time.perf_counter()
    compiled = _compile(lowered)
    logger.info("compiled a %s variant in the background: traced in %.1f s, compiled in %.1f s",
                name, traced - start, time.perf_counter() - traced)
    return compiled


def _abstract(x):
    """An argument as the worker traces it: shape, dtype and (for a device array) sharding, never the buffer
    (the calling thread may have donated it by then)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _compile(lowered):
    return lowered.compile()
