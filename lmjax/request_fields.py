"""Request fields lmjax adds on the host beyond the sampling numbers: vLLM's RequestOutputKind and logits
processors, LMDeploy's output kinds ("generation" / "all") and its (input_ids, logits) processor form. Checked
by SamplingParams and GenerationConfig (lmjax.config); run by lmjax.engine.host_outputs."""
from __future__ import annotations

import enum

from lmjax.validation import check as _check


class RequestOutputKind(enum.Enum):
    """vLLM's: each RequestOutput of a streaming engine (lmjax.LLMEngine.step) holds everything so far
    (CUMULATIVE), only what is new since the last one (DELTA), or comes once, when finished (FINAL_ONLY)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


OUTPUT_KINDS = (None, "generation", "all")


def check_processors(processors) -> list | None:
    """None or a list of callables (a lone callable becomes a list of one)."""
    if processors is None:
        return None
    items = [processors] if callable(processors) else list(processors)
    bad = [f for f in items if not callable(f)]
    _check(not bad, f"logits_processors must be callables, got {bad[0]!r}" if bad else "")
    return items or None


def check_output_kinds(obj) -> None:
    for name in ("output_logits", "output_last_hidden_state"):
        value = getattr(obj, name)
        _check(value in OUTPUT_KINDS, f"{name} must be None, 'generation' or 'all', got {value!r}")


class AllIds:
    """An LMDeploy logits processor, `f(input_ids, logits)` with input_ids the sequence's ids so far (prompt
    and output), called as vLLM's three-argument form `f(prompt_ids, output_ids, logits)`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, prompt_ids, output_ids, logits):
        import numpy as np  # light module: numpy only when a processor runs
        return self.fn(np.asarray([*prompt_ids, *output_ids], np.int64), logits)

    def __repr__(self) -> str:
        return f"LMDeploy processor {self.fn!r}"
