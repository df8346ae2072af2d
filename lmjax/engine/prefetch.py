"""While a served engine is idle after warm-up, its compile worker takes the programs of the sampling its requests
will likely bring: plain temperature sampling (OpenAI's default, and a bare vLLM SamplingParams') and the
checkpoint's own defaults (generation_config.json: Llama-3-Instruct's temperature 0.6 + top-p 0.9, say).

Warm-up compiles the decode call of every (batch bucket, block-table width) for greedy sampling only: the sampler
sits inside the multi-step decode call, so each sampling variant is a whole-model program, and warming up a
second one would double the start-up. A sampled request met after warm-up decoded one step per call (and its
first step also compiled a small sampler program) while its decode variant compiled on the worker: a new 1B
server's first temperature-0.8 request took 1.95 s against 0.28 s greedy (BENCHMARKS.md, session 30). Here
those programs go to the worker one at a time, each when it is free (a variant a request meets in the meantime
is handed over at once, as before, so it never queues behind them), narrowest block table first; the
persistent compilation cache keeps them for the next start. `LMJAX_PREFETCH_SAMPLING=0` turns it off.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from lmjax.config import SamplingParams
from lmjax.engine.decode_loop import padding_decode_args
from lmjax.engine.model_runner import ModelRunner
from lmjax.env import env_choice
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata

logger = logging.getLogger("lmjax.engine")
PLAIN_SAMPLING = SamplingParams(temperature=1.0)


def prefetch_enabled() -> bool:
    return env_choice("LMJAX_PREFETCH_SAMPLING", ("1", "0"), "1") == "1"


def prefetch_rows(defaults: dict) -> list[SamplingRow]:
    """Plain temperature sampling, and the checkpoint's sampling defaults (SamplingParams fields) when they
    sample (a variant of their own when they set top-k / top-p / penalties)."""
    params = [PLAIN_SAMPLING]
    try:
        checkpoint = SamplingParams(**defaults) if defaults else None
    except (TypeError, ValueError) as e:  # (the requests taking them fail with the reason; no variant to expect)
        logger.warning("no prefetch for the checkpoint's sampling defaults %s: %s", defaults, e)
        checkpoint = None
    if checkpoint is not None and checkpoint.temperature > 0:
        params.append(checkpoint)
    return [SamplingRow(p, seed=0) for p in params]


class SamplingPrefetch:
    """The programs still to hand over; `step()` hands the next one to the worker when it has nothing else."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], widths: list[int], rows: list[SamplingRow],
                 num_steps: int, large_rows: list[int]):
        self.runner = runner
        self._jobs: Iterator[Callable[[], None]] = iter([
            *(self._sampler_job(row, R) for row in rows for R in large_rows),
            # narrow tables first (short contexts: what most requests meet), every batch bucket of each
            *(self._decode_job(B, M, row, num_steps) for M in widths for B in batch_sizes for row in rows
              if num_steps > 1)])  # (one-step engines decode through the padded steps: no decode call of its own)
        self._next: Callable[[], None] | None = next(self._jobs, None)
        self.num_handed = 0

    def step(self) -> bool:
        """Hand the next program to the worker unless it is busy; whether any remain."""
        if self._next is None:
            return False
        if not self.runner.compilers_busy():
            try:
                self._next()
                self.num_handed += 1
            except Exception:  # noqa: BLE001  (a prefetch is an optimisation: never the engine thread's failure)
                logger.exception("prefetching a sampling program failed")
            self._next = next(self._jobs, None)
        return self._next is not None

    def _sampler_job(self, row: SamplingRow, R: int) -> Callable[[], None]:
        """The sampler a step sampled apart at R rows runs (a padded one-step call's, for this sampling)."""
        def job():
            smeta, flags = build_sampling_metadata([row], pad_to=R)
            self.runner.prefetch_sampler(smeta, flags, R)
        return job

    def _decode_job(self, B: int, M: int, row: SamplingRow, num_steps: int) -> Callable[[], None]:
        """The multi-step decode call of B rows and table width M for this sampling (traced on the worker)."""
        def job():
            smeta, flags = build_sampling_metadata([row], pad_to=B)
            inputs, smeta = padding_decode_args(self.runner, B, M, smeta)
            self.runner.prefetch_decode(inputs, smeta, flags, num_steps)
        return job
