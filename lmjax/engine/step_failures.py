"""What the engine does when a scheduled step fails: its inputs could not be built (StepInputError: nothing
reached the device), or anything raised between `schedule()` and the step's results being applied (a device
error, a logits processor's exception). Either way the step's KV may never have been written, while the
prefix cache already names the blocks it was to fill (they are hashed when allocated, so that sequences
admitted in the same step share them: lmjax.engine.block_manager). `Scheduler.discard` takes those hashes
back and sends whoever would read the unwritten blocks back to recompute them. Mixed into LLMEngine, whose
scheduler, `_by_seq`, `_finish` and `_pending` it uses."""
from __future__ import annotations

import logging

from lmjax.engine.model_runner import rows_pack
from lmjax.engine.request import Request
from lmjax.engine.scheduler import ScheduledBatch
from lmjax.layers.sampler import SamplingRow

logger = logging.getLogger("lmjax.engine")


class StepFailuresMixin:
    def _step_failed(self, batch: ScheduledBatch) -> None:
        """A step that raised: no request may later read a block it did not write. A multi-step decode call
        chained behind it (`_decode_after`) took its input tokens from it: dropped too. The exception goes
        on to the caller (the facades then abort the requests; a direct caller may step on)."""
        self._pending = None
        self.scheduler.discard(batch)

    def _inputs_failed(self, batch: ScheduledBatch, rows: list[SamplingRow], starts: list[int], error: Exception,
                       changed: dict[str, Request]) -> list[Request]:
        """A step whose host-side inputs could not be built: nothing reached the device, so the requests whose
        own sampling rows fail alone end with "error" and the rest of the batch runs next step (`schedule`
        picks it again: its blocks are kept and nothing advanced, except that a sequence admitted onto blocks
        this step was to write goes back to the queue: `Scheduler.discard`). When no row is to blame, the
        batch ends."""
        logger.error("step inputs could not be built: %s", error)
        self.scheduler.discard(batch)  # first: a blamed writer's blocks must not stay matchable once freed
        live = [(it, rows[starts[i]:starts[i] + it.num_rows]) for i, it in enumerate(batch.items)
                if it.seq.seq_id in self._by_seq]
        blamed = [it for it, own in live if not rows_pack(own)] or [it for it, _ in live]
        for it in blamed:
            req, comp = self._by_seq[it.seq.seq_id]
            req.error = f"the step's sampling inputs could not be built: {error}"
            self._finish(req, comp, "error")
            changed[req.request_id] = req
        return list(changed.values())
