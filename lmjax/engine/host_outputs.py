"""What a step hands to the host beyond sampled tokens: logits for per-request logits processors (vLLM's
`SamplingParams.logits_processors`, LMDeploy's `GenerationConfig.logits_processors`) and LMDeploy's
`output_logits` / `output_last_hidden_state` ("generation" or "all").

Logits processors. Each is called on the host, once per sampled token of each completion, in the order
given, on the raw float32 logits (before logit_bias, penalties, bans, guides, temperature and top-k/p, as
vLLM V0 and LMDeploy order them): vLLM's form `f(output_ids, logits)` or `f(prompt_ids, output_ids, logits)`
(chosen by the number of parameters, as vLLM does), ids as lists; LMDeploy's `f(input_ids, logits)`, input_ids
the prompt and output ids as one int64 array (config._AllIds adapts it). `logits` is a writable numpy float32
array [V], not a torch tensor (lmjax has no torch): code that indexes and assigns (`logits[ids] = -inf`) or
uses numpy works unchanged; whatever is returned is read with `np.asarray` (numpy, a JAX array or a CPU torch
tensor) and must have shape [V]. Logprobs stay those of the raw logits (vLLM V1's default). A processor that
raises or returns a wrong shape ends its own completion with finish reason "error" (the message in
`Request.error`); the batch's other requests go on.

Outputs. "generation": one row per generated token, the raw logits it was sampled from (or the final-norm
hidden state at that position): [num_generated, V] / [num_generated, D]. "all": one row per position the engine
computed for the request, in order: the prompt's positions (the last one gives the first generated token) and
then every generated token but the last, [len(prompt) + num_generated - 1, ...]. A request with "all"
computes its whole prompt (no prefix-cache hits; LMDeploy refuses the combination instead); in a session
the turn's earlier history is not recomputed, so its rows start at this turn's first new position.

Cost: such a request runs one decode step per host round trip (no multi-step calls), and each of its steps
copies its rows to the host. Not across hosts (a multi-process tensor-parallel engine refuses these requests).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import NamedTuple

import numpy as np

from lmjax.config import SamplingParams


class Extras(NamedTuple):
    """What one step computes beyond the sampled tokens (static: each distinct value is a compilation).
    sample False: the step returns the last rows' logits and the host samples after its processors ran."""
    sample: bool = True
    last_logits: bool = False
    last_hidden: bool = False
    all_logits: bool = False
    all_hidden: bool = False


NO_EXTRAS = Extras()


def needs_host(p: SamplingParams) -> bool:
    """A request whose every sampled token passes through the host (no multi-step decode calls)."""
    return bool(p.logits_processors) or p.output_logits is not None or p.output_last_hidden_state is not None


def extras_for(items: list[tuple[SamplingParams, bool]]) -> Extras:
    """The step's Extras for its items, (params, samples) each."""
    def any_(cond):
        return any(cond(p, samples) for p, samples in items)
    return Extras(
        sample=not any_(lambda p, s: s and bool(p.logits_processors)),
        last_logits=any_(lambda p, s: s and p.output_logits == "generation"),
        last_hidden=any_(lambda p, s: s and p.output_last_hidden_state == "generation"),
        all_logits=any_(lambda p, _: p.output_logits == "all"),
        all_hidden=any_(lambda p, _: p.output_last_hidden_state == "all"))


@dataclasses.dataclass
class HostRows:
    """A completion's collected rows, by position (a recomputed position, after a preemption, keeps its
    first row)."""
    logits: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    hidden: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def put(self, kind: str, position: int, row: np.ndarray) -> None:
        getattr(self, kind).setdefault(position, row)

    def stacked(self, kind: str) -> np.ndarray | None:
        rows = getattr(self, kind)
        return np.stack([rows[p] for p in sorted(rows)]) if rows else None


def call_processors(processors: list, prompt_ids: list[int], output_ids: list[int], logits_V: np.ndarray) -> np.ndarray:
    """Run a completion's processors in order on a copy of its raw logits; raises ValueError (naming the
    processor) for a result of another shape, or one nothing can be sampled from (`_check_samplable`)."""
    V = logits_V.shape[0]
    row = np.array(logits_V, np.float32)  # a writable copy: processors may assign in place
    for fn in processors:
        out = fn(list(prompt_ids), list(output_ids), row) if _arity(fn) == 3 else fn(list(output_ids), row)
        out = np.asarray(out if out is not None else row, np.float32)
        if out.shape != (V,):
            raise ValueError(f"logits processor {fn!r} returned shape {out.shape}, expected ({V},)")
        _check_samplable(fn, out)
        row = np.array(out)  # writable again for the next processor
    return row


def _check_samplable(fn, logits_V: np.ndarray) -> None:
    """A ValueError naming the processor whose logits hold a NaN or are all -inf: the sampler's argmax would
    pick an arbitrary token from them (id 0, often a special one) instead of failing the request."""
    nan_ids = np.flatnonzero(np.isnan(logits_V))
    if nan_ids.size:
        raise ValueError(f"logits processor {fn!r} returned NaN logits (at ids {nan_ids[:5].tolist()})")
    if not (logits_V > -np.inf).any():
        raise ValueError(f"logits processor {fn!r} returned -inf for every token: nothing is left to sample")


def _arity(fn) -> int:
    """vLLM's rule: three parameters mean (prompt_ids, output_ids, logits), else (output_ids, logits)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 3 if len(positional) == 3 else 2


class HostOutputsMixin:
    """The engine's side (mixed into LLMEngine: `_by_seq`, `runner`): which extras a step needs, the
    processors between the step and its sampling, and the rows each completion keeps."""

    def _extras(self, batch) -> Extras:
        items = [(self._by_seq[it.seq.seq_id][0].params, it.samples) for it in batch.items
                 if it.seq.seq_id in self._by_seq]
        return extras_for(items) if any(needs_host(p) for p, _ in items) else NO_EXTRAS

    def _process_logits(self, batch, pending, starts: list[int]) -> dict[int, str]:
        """Run the processors of the step's sampling items, then sample; returns {seq_id: error} for
        completions whose processor failed (their rows sampled raw, their tokens to be dropped)."""
        import jax  # the engine's modules import jax anyway; this one stays light for config checks

        rows_R, failed = [], {}
        items = []
        for i, it in enumerate(batch.items):
            if it.samples and it.seq.seq_id in self._by_seq and self._by_seq[it.seq.seq_id][0].params.logits_processors:
                items.append(i)
                rows_R.append(starts[i])  # one row: speculation skips requests with processors
        raw_RV = np.asarray(jax.device_get(pending.extra["last_logits"][np.asarray(rows_R)])) if rows_R else []
        processed, kept = [], []
        for i, row, raw_V in zip(items, rows_R, raw_RV):
            seq = batch.items[i].seq
            req, _ = self._by_seq[seq.seq_id]
            try:
                processed.append(call_processors(req.params.logits_processors, req.prompt_token_ids,
                                                 seq.output_token_ids, raw_V))
                kept.append(row)
            except Exception as e:  # noqa: BLE001 - the user's code: its request fails, not the engine
                failed[seq.seq_id] = f"logits processor failed: {type(e).__name__}: {e}"
        self.runner.sample_processed(pending, kept, processed)
        return failed

    def _record_extras(self, batch, pending, starts: list[int]) -> None:
        """Copy the rows completions asked for (output_logits / output_last_hidden_state) to the host."""
        import jax

        # last_logits is there for the processors too; copied only when a completion keeps them
        wanted = {k: x for k, x in pending.extra.items() if k != "last_logits" or _any_generation_logits(
            batch, self._by_seq)}
        host = jax.device_get(wanted)
        t = 0
        for i, it in enumerate(batch.items):
            entry = self._by_seq.get(it.seq.seq_id)
            rows = entry[1].host_rows if entry is not None else None
            if rows is not None:
                p = entry[0].params
                for kind, mode in (("logits", p.output_logits), ("hidden", p.output_last_hidden_state)):
                    if mode == "all":
                        for j in range(it.num_new_tokens):
                            rows.put(kind, it.start_pos + j, host[f"all_{kind}"][t + j])
                    elif mode == "generation" and it.samples:
                        rows.put(kind, it.start_pos + it.num_new_tokens - 1, host[f"last_{kind}"][starts[i]])
            t += it.num_new_tokens


def _any_generation_logits(batch, by_seq) -> bool:
    return any(by_seq[it.seq.seq_id][0].params.output_logits == "generation" for it in batch.items
               if it.samples and it.seq.seq_id in by_seq)
