"""Warm-up: compile at start-up what a run would otherwise compile in its middle, by running each program on
padding only (no valid sequence: every KV write lands in the sink block 0, so no sequence's cache changes).

The decode call of every (batch bucket, block-table width) for the warm-up's sampling variants (vLLM captures a
CUDA graph per batch size likewise), and, where one-step calls may run at a larger compiled shape
(lmjax.engine.step_shapes), a few large one-step shapes so that every later step has one to run at while its
own compiles: the largest (max tokens, sequences, rows and width) and one of 1/MAX_T_RATIO of its tokens, each
fused with the warm-up's sampling and sampled apart (the shared step every other variant runs).

Every program is first lowered here and compiled on a pool of threads (lmjax.engine.parallel_compile), then run
once, one after another, as before."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from lmjax.config import SamplingParams
from lmjax.engine.background_compile import variant_key
from lmjax.engine.decode_loop import padding_decode_args, pending_ids
from lmjax.engine.model_runner import ModelRunner, StepInputs, bucket
from lmjax.engine.padded_steps import step_variant
from lmjax.engine.parallel_compile import Precompiler, paused_gc
from lmjax.engine.prefetch import SamplingPrefetch, prefetch_enabled, prefetch_rows
from lmjax.engine.step_shapes import MAX_T_RATIO, StepDims, pad_step_inputs
from lmjax.layers.attention import AttentionMetadata
from lmjax.layers.sampler import SamplingFlags, SamplingMetadata, SamplingRow, build_sampling_metadata, is_basic

logger = logging.getLogger("lmjax.engine")
# Any non-basic variant: its step is the shared one (sampled apart), and top-p's sampler program is compiled too.
_APART_ROW = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), seed=0)


@dataclasses.dataclass
class WarmupProgram:
    lower: Callable[[], Any]  # the program lowered as its run calls it (jax's Lowered)
    run: Callable[[], Any]  # runs it on padding; what to block on
    key: tuple  # what selects the lowered program: programs of one key are lowered and compiled once
    run_key: tuple  # and what selects all its run compiles (a step sampled apart also compiles its sampler)


def padding_step(dims: StepDims) -> StepInputs:
    """One-step inputs of `dims` holding no token of any sequence (an empty step padded as steps are)."""
    none = np.zeros(0, np.int32)
    attn = AttentionMetadata(slot_mapping_T=none, seq_lens_T=none, kv_lens_B=none,
                             block_tables_BM=np.zeros((0, 0), np.int32), cu_q_lens_B1=np.zeros(1, np.int32))
    empty = StepInputs(ids_T=none, positions_T=none, attn=attn, last_rows_B=none, next_ids_T=none)
    return pad_step_inputs(empty, dims)


def _step_program(runner: ModelRunner, dims: StepDims, smeta: SamplingMetadata, flags: SamplingFlags):
    fused = is_basic(flags, smeta)  # else every variant runs the one step sampled apart, then its own sampler
    key = ("step", step_variant(padding_step(dims), smeta, flags, fused)[2])
    return WarmupProgram(lambda: runner.lower_step(padding_step(dims), smeta, flags),
                         lambda: runner._run(padding_step(dims), smeta, flags, -1)[0],
                         key, key + (variant_key(smeta, {"flags": flags}),))


def _decode_program(runner: ModelRunner, B: int, M: int, smeta: SamplingMetadata, flags: SamplingFlags,
                    num_steps: int):
    def args():
        return padding_decode_args(runner, B, M, smeta)

    def run():
        out = runner._run_decode(*args(), flags, num_steps, now=True)
        jax.block_until_ready(pending_ids(out.token_ids_B, rows=B))  # a chained call's input tokens
        return out

    key = ("decode", B, M, num_steps, variant_key(smeta, {"flags": flags}))
    return WarmupProgram(lambda: runner.lower_decode(*args(), flags, num_steps), run, key, key)


def decode_programs(runner: ModelRunner, batch_sizes: list[int], widths: list[int], rows: list[SamplingRow],
                    num_steps: int) -> list[WarmupProgram]:
    """The decode call of each (batch bucket B, table width M) for the sampling flags of `rows`."""
    programs = []
    for B in batch_sizes:
        smeta, flags = build_sampling_metadata(rows, pad_to=B)
        for M in widths:
            programs.append(_decode_program(runner, B, M, smeta, flags, num_steps) if num_steps > 1 else
                            _step_program(runner, StepDims(bucket(B, 16), B, B, M), smeta, flags))
    return programs


def large_step_dims(runner: ModelRunner) -> list[StepDims]:
    """The one-step shapes warm-up compiles for padding: every dimension at its largest, and the same with
    1/MAX_T_RATIO of the tokens (so a step of 16 tokens pads to at most 16x, not 1,000x)."""
    tokens = sorted({runner.max_T, max(16, runner.max_T // MAX_T_RATIO)})
    return [StepDims(T, runner.max_B, runner.max_B, runner.max_M) for T in tokens]


def step_programs(runner: ModelRunner, rows: list[SamplingRow]) -> list[WarmupProgram]:
    """large_step_dims' shapes with each of `rows`' sampling (fused, or sampled apart), and sampled apart."""
    return [_step_program(runner, dims, *build_sampling_metadata([row], pad_to=dims.R))
            for dims in large_step_dims(runner) for row in [*rows, _APART_ROW]]


def run_warmup(runner: ModelRunner, programs: list[WarmupProgram], chain_batch_sizes: list[int] | None) -> dict:
    """Lower and compile `programs` on the pool (once per key), then run each (once per run key); with
    `chain_batch_sizes` (padded steps: the step programs are among them) also the tiny programs that hand a
    one-step call's tokens (its R rows, padded or not) to a decode call of B rows chained after it. Returns the
    pool's figures."""
    precompiler, out = Precompiler(), None
    lowering = list({program.key: program for program in programs}.values())
    running = list({program.run_key: program for program in programs}.values())
    with paused_gc():  # (with one thread, runs trace)
        for program in lowering:
            precompiler.add(program.lower)
        stats = precompiler.wait()
        for program in running:
            out = jax.block_until_ready(program.run())
    if chain_batch_sizes is not None:
        for B in chain_batch_sizes:
            for R in {runner.max_B, bucket(B, 4)}:
                jax.block_until_ready(pending_ids(out.token_ids_B[:R], rows=B))
        runner.pad_warmed = True  # now a new basic decode variant may compile on the worker too
    return stats


def warm_up(engine, sampling_params: list[SamplingParams] | None, max_batch_size: int | None):
    """LLMEngine.warmup's work (its docstring says what). Returns its figures, and what the engine's compile worker
    may take while it idles (lmjax.engine.prefetch; None where it would not use them)."""
    runner, config = engine.runner, engine.config
    start, compiled = time.perf_counter(), runner.num_compilations
    rows = [SamplingRow(p, seed=0) for p in (sampling_params or [SamplingParams(temperature=0.0)])]
    top = bucket(min(max_batch_size or config.max_batch_size, config.max_batch_size), 4)
    floor = runner.min_decode_B if config.num_scheduler_steps > 1 else 4
    sizes = [1 << i for i in range(floor.bit_length() - 1, top.bit_length())]
    widths = [runner.max_M] if runner.fixed_M else [1 << i for i in range(runner.max_M.bit_length())]
    pad = runner.pad_to_compiled
    programs = [program for row in rows for program in
                decode_programs(runner, sizes, widths, [row], config.num_scheduler_steps)]
    programs += step_programs(runner, rows) if pad else []  # (duplicates lowered and run once)
    pool = run_warmup(runner, programs, sizes if pad else None)  # (the precompile pool's figures)
    stats = {"compilations": runner.num_compilations - compiled, "seconds": round(time.perf_counter() - start, 3),
             **pool}
    logger.info("warm-up: %s (batch buckets %s, widths %s)", stats, sizes, widths)
    # Only a padding engine uses the worker's programs of a basic variant (else jit compiles them when met).
    prefetch = None
    if pad and runner.decode_compiles_apart() and prefetch_enabled():
        prefetch = SamplingPrefetch(runner, sizes, widths, prefetch_rows(engine.sampling_defaults),
                                    config.num_scheduler_steps, sorted({d.R for d in large_step_dims(runner)}))
    return stats, prefetch
