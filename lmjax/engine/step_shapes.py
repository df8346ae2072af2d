"""One-step calls run at a larger compiled shape while their own shape compiles on a worker thread.

A one-step call (prefill chunks and decode tokens, lmjax.engine.model_runner) is padded to power-of-two buckets
of tokens T, sequences B, sampled rows R and block-table width M, and each new combination is a compilation of
the whole model: seconds to tens of seconds on a GPU, during which every running request waits. A server meets
new combinations for hours (prompt lengths, batch sizes and context lengths vary; warm-up covers the decode
call's buckets only), where vLLM, compiling for symbolic token counts and keeping attention outside its graphs,
never stalls. So, where this is on (LMJAX_PAD_TO_COMPILED: by default on a GPU with background compilation on),
a call whose shape is not compiled yet runs at the smallest compiled shape that holds it (every dimension at
least as large; padding tokens write to the sink block, padding sequences have no tokens, padding rows are
greedy and dropped), at most MAX_T_RATIO times its tokens, while its own shape compiles on a worker thread
(lmjax.engine.background_compile) and is used once ready. Warm-up compiles a few large shapes so that one
always exists (ModelRunner.warmup_steps). A padded program computes the same tokens up to rounding: on a GPU
another shape may round differently, so LMJAX_PAD_TO_COMPILED=0 (or LMJAX_BACKGROUND_COMPILE=0) compiles each
shape when met instead, for runs that must repeat bit for bit.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from lmjax.engine.background_compile import background_compile_enabled
from lmjax.env import env_choice

MAX_T_RATIO = 64  # a padded call computes at most this many times its own tokens (else: compile now)


def pad_to_compiled_enabled() -> bool:
    """LMJAX_PAD_TO_COMPILED: "auto" (the default) on a GPU, "1" anywhere, "0" never; LMJAX_BACKGROUND_COMPILE=0
    turns it off too."""
    choice = env_choice("LMJAX_PAD_TO_COMPILED", ("auto", "1", "0"), "auto")
    if choice == "0" or not background_compile_enabled():
        return False
    return choice == "1" or jax.default_backend() == "gpu"


class StepDims(NamedTuple):
    """A one-step call's bucketed sizes: tokens, sequences, sampled rows, block-table width."""
    T: int
    B: int
    R: int
    M: int

    def holds(self, other: "StepDims") -> bool:
        return all(a >= b for a, b in zip(self, other))


def step_dims(inputs) -> StepDims:
    return StepDims(inputs.ids_T.shape[0], inputs.attn.kv_lens_B.shape[0], inputs.last_rows_B.shape[0],
                    inputs.attn.block_tables_BM.shape[1])


def shape_family(inputs, smeta, static: dict) -> tuple:
    """What must match besides the dimensions for one program to run another's call: the static arguments,
    the pytree structure, dtypes, and the sampling metadata's widths past its rows (penalty tokens, bans, mask,
    bias)."""
    leaves, treedef = jax.tree_util.tree_flatten((inputs, smeta))
    meta_leaves = jax.tree_util.tree_leaves(smeta)
    return (treedef, tuple(str(x.dtype) for x in leaves), tuple(np.shape(x)[1:] for x in meta_leaves),
            tuple(sorted(static.items())))


class CompiledShapes:
    """The one-step shapes compiled so far, per shape family."""

    def __init__(self):
        self._dims: dict[tuple, set[StepDims]] = {}

    def add(self, family: tuple, dims: StepDims) -> None:
        self._dims.setdefault(family, set()).add(dims)

    def has(self, family: tuple, dims: StepDims) -> bool:
        return dims in self._dims.get(family, ())

    def smallest_holding(self, family: tuple, dims: StepDims,
                         usable: Callable[[StepDims], bool] = lambda d: True) -> StepDims | None:
        """The compiled shape of `family` that holds `dims` at the least padding (tokens first), within
        MAX_T_RATIO of its tokens, and `usable`; None when there is none."""
        fits = [d for d in self._dims.get(family, ())
                if d.holds(dims) and d.T <= MAX_T_RATIO * dims.T and usable(d)]
        return min(fits, default=None, key=lambda d: (d.T, d.R, d.B, d.M))


def pad_step_inputs(inputs, dims: StepDims):
    """Numpy step inputs padded to `dims`, as ModelRunner.build_inputs pads: padding tokens write to slot 0
    (the sink block) at position 0, padding sequences have no tokens and no context, padding rows read row 0."""
    T, B, R, M = step_dims(inputs)
    attn = inputs.attn

    def pad(x, n, value):
        return np.concatenate([np.asarray(x), np.full(n - x.shape[0], value, np.asarray(x).dtype)])

    tables_BM = np.zeros((dims.B, dims.M), np.int32)
    tables_BM[:B, :M] = attn.block_tables_BM
    cu_B1 = np.asarray(attn.cu_q_lens_B1)
    new_attn = type(attn)(slot_mapping_T=pad(attn.slot_mapping_T, dims.T, 0),
                          seq_lens_T=pad(attn.seq_lens_T, dims.T, 1),
                          kv_lens_B=pad(attn.kv_lens_B, dims.B, 0), block_tables_BM=tables_BM,
                          cu_q_lens_B1=pad(cu_B1, dims.B + 1, cu_B1[-1]))
    return type(inputs)(ids_T=pad(inputs.ids_T, dims.T, 0), positions_T=pad(inputs.positions_T, dims.T, 0),
                        attn=new_attn, last_rows_B=pad(inputs.last_rows_B, dims.R, 0),
                        next_ids_T=pad(inputs.next_ids_T, dims.T, -1))
