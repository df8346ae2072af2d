"""One trace for all the decoder layers of a model, in the engine's programs.

The layers are a Python list, unrolled under jit (faster than scanning stacked weights on a GPU), so a step's
trace and lowering ran every layer's Python and built every layer's MLIR (and every Pallas kernel's Triton IR)
again: that is most of the 0.4-0.8 s a 1B decode program takes to lower, paid at warm-up for each of its
programs and on the engine's thread for each shape met while serving. Inside `shared_layer_traces`, each
layer is called through one jitted function of (the layer's graph, its parameters, its inputs): layers of the
same structure share one trace and one lowered function, called once per layer; XLA inlines the calls before
it optimizes, so the compiled program is the one before (tests/models/test_layer_trace.py: same tokens, fewer
traces). Layers whose static structure differs (a sliding window on some layers only, say) trace apart.

The engine makes one tracer per ModelRunner: jit's cache must not outlive the trace-time settings (LMJAX_*
switches, the mesh) of the engine it traced for. Outside the context (research code calling the model, the
calibration forward that sows intermediates) layers run inline as before.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
from flax import nnx

_TRACER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("lmjax_layer_tracer", default=None)


def _run_layer(graphdef, state, *args):
    return nnx.merge(graphdef, state)(*args)


def layer_tracer() -> Callable:
    """A jitted layer call (graphdef static): its cache holds one trace per layer structure and input shapes.
    A function of its own per tracer: jax's jaxpr cache is keyed by the traced function (process-wide), so a
    shared module-level function would hand one engine's layer traces to the next engine of the same shapes,
    whatever that engine's trace-time settings (LMJAX_ATTENTION_IMPL, ...)."""
    def run_layer(graphdef, state, *args):
        return _run_layer(graphdef, state, *args)

    return jax.jit(run_layer, static_argnums=0)


@contextlib.contextmanager
def shared_layer_traces(tracer: Callable):
    """Layers called through `call_layer` inside go through `tracer` (this thread's traces only)."""
    token = _TRACER.set(tracer)
    try:
        yield
    finally:
        _TRACER.reset(token)


def call_layer(layer: nnx.Module, *args):
    """layer(*args), through the current tracer if any."""
    tracer = _TRACER.get()
    if tracer is None:
        return layer(*args)
    graphdef, state = nnx.split(layer)
    return tracer(graphdef, state, *args)
