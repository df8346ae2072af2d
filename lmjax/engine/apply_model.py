"""vLLM's `LLM.apply_model(func)`: run a function on the engine's model and make whatever parameter values
it set the weights every later step reads (researchers' ablations and patched weights).

The runner's jitted steps read a flat list of arrays (`ModelRunner.params`), not the module: a module
edited outside this function (e.g. one built by `nnx.merge(runner.graphdef, runner.state)`) leaves the
engine's steps on the old weights. The model `func` gets is the engine's own layout: q/k/v and gate/up
merged into one projection each, and on one GPU out-major (transposed) weights for small models.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

_R = TypeVar("_R")


def engine_model(runner) -> nnx.Module:
    """A module over the arrays the engine's steps read now (fresh Variables: editing it changes nothing
    in the engine; `apply_model` does)."""
    return nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._params_def, runner.params))


def apply_model(engine, func: Callable[[nnx.Module], _R]) -> _R:
    """func(model) on a copy of the engine's model; then its parameter values become the engine's (each
    placed as the one it replaces) and no request reuses KV cached from the old weights. Changing the
    model's structure, or a parameter's shape or dtype, is refused and leaves the engine as it was.
    Requests running meanwhile keep the KV they have; quant_policy 4's KV calibration (from engine start)
    stays."""
    runner = engine.runner
    if runner.leading:
        raise NotImplementedError("apply_model is not supported by a multi-process engine led by one process")
    model = engine_model(runner)
    result = func(model)
    graphdef, state = nnx.split(model)
    params, params_def = jax.tree_util.tree_flatten(state)
    if graphdef != runner.graphdef or params_def != runner._params_def:
        raise ValueError("apply_model's function may change parameter values, not the model's structure")
    for path, old, new in zip(_paths(runner.state), runner.params, params):
        if (old.shape, old.dtype) != (new.shape, new.dtype):
            raise ValueError(f"apply_model's function changed {path} from {old.dtype}{list(old.shape)} to "
                             f"{new.dtype}{list(new.shape)}: keep each parameter's shape and dtype")
    runner.params = [new if new is old else _placed_like(new, old) for old, new in zip(runner.params, params)]
    runner.state = jax.tree_util.tree_unflatten(params_def, runner.params)
    # Blocks cached from the old weights are never shared again (a new salt), and are forgotten now when
    # no request or session holds one (a kept session's next turn recomputes: its salt differs too).
    engine.weights_version += 1
    engine.blocks.reset_prefix_cache()
    _resalt_waiting(engine)
    return result


def _placed_like(new, old) -> jax.Array:
    """`new` on `old`'s sharding, strongly typed as `old` is: a weakly typed value (jnp.full(shape, 1.0))
    has the same shape and dtype, but the steps' jit caches key on weak_type, so every one would compile
    again."""
    return jax.device_put(jnp.asarray(new).astype(old.dtype), old.sharding)


def _resalt_waiting(engine) -> None:
    """Queued sequences holding no KV yet took the old weights' salt when they were added: give them the new
    one, or they would share blocks cached from the old weights (kept while a running request holds a block)."""
    for seq in engine.scheduler.waiting:
        if not seq.block_table:
            seq.cache_salt = engine._cache_salt(seq.num_prompt_tokens, getattr(seq.params, "cache_salt", None))
            seq.block_hashes.clear()


def _paths(state) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
