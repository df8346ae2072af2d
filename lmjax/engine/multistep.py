"""Multi-step decode in the engine (vLLM's "multi-step scheduling" with its async output processing):
when the next K decode steps of a batch need no host decision, one jitted call runs them
(lmjax.engine.decode_loop), and the next call is dispatched before the previous one's tokens are read,
so at batch 1 the device never waits for the host. Mixed into LLMEngine, whose scheduler, block manager,
runner and `_pending` (the call in flight: (batch, PendingDecode)) it uses."""
from __future__ import annotations

from lmjax.engine.host_outputs import needs_host
from lmjax.engine.request import Request
from lmjax.engine.scheduler import ScheduledBatch, ScheduledItem


class MultiStepMixin:
    def _decode_after(self, batch: ScheduledBatch, pending) -> None:
        """When every item of a step just dispatched samples (its prompt done, or a decode token), start
        the batch's first multi-step decode call behind it before reading its tokens: it takes them on
        the device, and the host's dispatch (~1.8 ms on the GPU machines' host, which the device
        otherwise waits for once a request) overlaps the step's own device time. The scheduler was
        advanced, so the sampled tokens are the only thing unread."""
        if not all(it.samples for it in batch.items):
            return
        decode = ScheduledBatch([ScheduledItem(it.seq, 1, it.seq.num_computed_tokens, True) for it in batch.items],
                                num_tokens=len(batch.items))
        k = self._decode_steps(decode, unread=1)
        if k > 1:
            pending.start_host_copy()
            rows = [self._row(it, ahead=1) for it in decode.items]
            self._chain(decode, self.runner.dispatch_decode(decode, rows, k, after=pending))

    def _chain(self, batch: ScheduledBatch, decoding) -> None:
        """Keep a chained call in flight; None: its sampling variant is still compiling (the blocks allocated
        for it are the batch's next tokens' anyway), and the batch steps once at a time meanwhile."""
        if decoding is not None:
            self._pending = (batch, decoding)
            self.num_decode_loops += 1
            self.num_chained_loops += 1

    def _decode_steps(self, batch: ScheduledBatch, ahead: int = 0, unread: int | None = None) -> int:
        """K > 1 when the next K decode steps need no host decision in between: all items decode,
        nothing per-step is host-computed (penalties, multi-token bad words, min_tokens bans, guides), and blocks
        for K more tokens are free (allocated here). While requests wait to join (the batch was full
        or the cache was), single steps take over when a request's max_tokens comes within K, so
        its slot frees on time; a request that ends earlier (EOS, a stop string) holds its slot to the
        end of the K steps.

        `unread` > 0 (default: `ahead`): a call of this batch is still in flight, its `unread` sampled
        tokens a sequence not read yet and `ahead` positions it computes past the host's count (a K-step
        call: K and K; a one-step call, the scheduler advanced: 1 and 0); K > 1 means the next call can
        follow it unchanged. That needs every sequence alive and inside max_tokens after the call in
        flight, and no waiting request that a free slot could take (the scheduler gets to admit it instead)."""
        unread = ahead if unread is None else unread
        k = self.config.num_scheduler_steps
        if k <= 1 or self.runner.leading:
            return 1
        waiting = self.scheduler.num_waiting
        if unread and waiting and len(batch.items) < self.config.max_batch_size:
            return 1
        if unread and self.scheduler.num_running > len(batch.items):
            return 1  # a sequence joined running outside this batch (a resumed session turn): schedule it
        for it in batch.items:
            if it.num_new_tokens != 1 or not it.samples or it.seq.seq_id not in self._by_seq:
                return 1
            req, comp = self._by_seq[it.seq.seq_id]
            p = req.params
            if (p.uses_penalties or req.bad_words_ids or comp.guide or needs_host(p)
                    or len(it.seq.output_token_ids) < p.min_tokens
                    or (self.config.speculative_config is not None and self._speculates(req, comp))):
                return 1
            if it.seq.num_computed_tokens + ahead + k > self.session_len:
                return 1
            remaining = req.max_tokens - len(comp.token_ids) - unread
            if unread and remaining <= 0:
                return 1  # it ends inside the call in flight: let the batch shrink
            if waiting:
                k = min(k, remaining)
        if k < self.config.num_scheduler_steps:  # K is static in the jitted loop: another K, another
            return 1  # compilation inside a run (measured: 3 of them, 15 s of a 19 s GPU benchmark)
        if sum(self.blocks.num_new_blocks(it.seq, ahead + k) for it in batch.items) > self.blocks.num_free_blocks:
            return 1
        for it in batch.items:
            self.blocks.append(it.seq, ahead + k)
        return k

    def _finish_pending(self, changed: dict) -> list[Request]:
        """Read the multi-step call in flight and apply its tokens, having first dispatched the next
        call of the same batch when it may follow unchanged (`_decode_steps(ahead=K)`): the device
        runs that one while the host post-processes this one, so it never waits for the host."""
        batch, pending = self._pending
        self._pending = None
        k = self._decode_steps(batch, ahead=pending.num_steps)
        if k > 1:
            rows = [self._row(it, ahead=pending.num_steps) for it in batch.items]
            self._chain(batch, self.runner.dispatch_decode(batch, rows, k, after=pending))
        self.num_loop_steps_read += pending.num_steps  # all K ran, even past a request's end
        self._catch_up_ending(batch, pending.num_steps)
        for out in self.runner.collect(pending):
            alive = [i for i, it in enumerate(batch.items) if it.seq.seq_id in self._by_seq]
            if not alive:
                break
            sampled = {batch.items[i].seq.seq_id: int(out.token_ids[i]) for i in alive}
            self.num_generated_tokens += self.scheduler.update(batch, sampled)
            for i in alive:
                req, comp = self._by_seq[batch.items[i].seq.seq_id]
                self._postprocess(req, comp, out, i)
                changed[req.request_id] = req
        return list(changed.values())

    def _catch_up_ending(self, batch: ScheduledBatch, num_steps: int) -> None:
        """Decode the deferred text of the requests that reach max_tokens in the call in flight now, while
        the device runs it: their finish would do it after the call, on the request's critical path
        (~1 ms for 128 tokens on the GPU machines' host)."""
        for it in batch.items:
            req, comp = self._by_seq.get(it.seq.seq_id, (None, None))
            if comp is not None and req.max_tokens - len(comp.token_ids) <= num_steps:
                comp.catch_up_text()
