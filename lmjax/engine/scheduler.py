"""Continuous batching: which sequences run in the next step, and with how many new tokens.

Every step is one unified ragged batch. A decoding sequence contributes its 1 new token, a prefilling
one a chunk of its prompt; the device step writes their KV into the paged cache and returns the logits
of each sequence's last token. Data flow per engine iteration:

    batch = scheduler.schedule()          # pick items, grow block tables (may preempt)
    sampled = run_step(batch)             # device: {seq_id: token} for items with samples=True
    scheduler.update(batch, sampled)      # advance num_computed_tokens, append tokens, hash blocks
                                          # (or advance(batch) at dispatch, record(batch, sampled) at read)
    scheduler.finish(seq, reason)         # engine decides EOS / stop / length
    scheduler.discard(batch)              # only when the step failed: nothing may read what it did not write

Policy: running sequences first, oldest first, each with all its uncomputed tokens, within the token
budget `max_prefill_token_num` (a long prefill is cut into chunks across steps). When the cache runs
out, blocks nobody runs on give way first (`reclaim`: idle sessions), then the newest running sequence is
preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue to be re-prefilled over prompt + output later. Waiting sequences are
admitted in order whenever batch slots, budget and blocks allow (not in a step that had to preempt).

Prefix caching: the blocks a step fills with known tokens are hashed as they are allocated (see
lmjax.engine.block_manager), so a waiting sequence admitted later in the same step shares a prompt that a
running or just-admitted one computes in that step (n > 1 siblings, a batch with a common few-shot prefix)
and schedules only its remainder. Such a block is written in the step that hashed it or not at all: a
preemption only takes sequences not yet scheduled in the step (and stops admission), so no writer leaves
after its blocks were shared; a step that fails is undone by `discard`.

Plain Python only (no jax, no numpy).
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lmjax.engine.block_manager import BlockManager
from lmjax.engine.sequence import Sequence, SequenceStatus
from lmjax.layers.sampler import NO_TOKEN


def _arrival(seq: Sequence) -> int:
    return seq.arrival


@dataclass
class ScheduledItem:
    """`num_new_tokens` tokens of `seq` from position `start_pos` are computed this step; when
    `samples`, they are the sequence's last tokens and the engine samples one token from the logits."""

    seq: Sequence
    num_new_tokens: int
    start_pos: int
    samples: bool
    admitted: bool = False  # taken from the waiting queue in this step (`Scheduler.discard` puts it back)

    @property
    def num_rows(self) -> int:
        """Positions sampled this step: the last one, or every position of a draft and the token before it."""
        return 1 + len(self.seq.draft_token_ids) if self.samples else 1


@dataclass
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # for logging; they are waiting again
    failed: list[Sequence] = field(default_factory=list)  # finished with reason "error": never fit
    num_tokens: int = 0
    advanced: bool = False  # Scheduler.advance ran: its items count their new tokens as computed

    def add(self, seq: Sequence, num_new_tokens: int, admitted: bool = False) -> None:
        start = seq.num_computed_tokens
        samples = start + num_new_tokens == seq.num_tokens + len(seq.draft_token_ids)
        self.items.append(ScheduledItem(seq, num_new_tokens, start, samples, admitted))
        self.num_tokens += num_new_tokens

    @property
    def is_empty(self) -> bool:
        return not self.items


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_prefill_token_num: int):
        if max_batch_size < 1 or max_prefill_token_num < 1:
            raise ValueError(f"{max_batch_size=} and {max_prefill_token_num=} must be >= 1")
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_prefill_token_num = max_prefill_token_num
        # Free blocks admission leaves untouched, so admitting does not force a preemption at once.
        self.watermark_blocks = max(1, block_manager.num_usable_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by arrival
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self.num_preemptions = 0
        # Frees KV blocks nobody runs on (the engine's idle interactive sessions); True if it freed any. Called
        # before a running sequence is preempted and before a waiting one is refused for lack of blocks, as
        # LMDeploy's scheduler evicts its hanging sequences first.
        self.reclaim: Callable[[], bool] = lambda: False

    # ---- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def fits_in_cache(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens could ever run (alone, in an empty cache).
        The engine should check prompt + max new tokens with this before `add`."""
        return self.bm.blocks_for(num_tokens) <= self.bm.num_usable_blocks

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (from any state): free its blocks, mark it FINISHED with `reason`."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.seqs.pop(seq.seq_id, None)

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a request in any state; returns it, or None if unknown or already finished."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's items and make sure each has cache slots for its new tokens."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_prefill_token_num)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Oldest first; the newest unscheduled running sequence gives way when blocks run out."""
        i, later_need = 0, None
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.draft_token_ids:  # a draft never takes blocks another sequence needs
                later_need = later_need or self._later_real_need()
                if not self.bm.can_append(seq, min(seq.num_uncomputed, budget), later_need[i]):
                    seq.draft_token_ids = []
            n = min(seq.num_uncomputed, budget)
            if seq.draft_token_ids and n < seq.num_uncomputed:  # the budget cuts the draft, never the real token
                seq.draft_token_ids = seq.draft_token_ids[:max(0, n - (seq.num_uncomputed - len(seq.draft_token_ids)))]
            if n == 0:  # the engine gave it no sampled token; nothing to compute
                i += 1
                continue
            while not self._fits(seq, n):
                victim = self.running[-1]  # index >= i: not scheduled in this step yet
                self._preempt(victim, batch)
                if victim is seq:
                    return budget  # everything after it is gone too
            self.bm.append(seq, n)
            self._register_ahead(seq, n)
            batch.add(seq, n)
            budget -= n
            i += 1
        return budget

    def _later_real_need(self) -> list[int]:
        """Per running index i, the blocks the sequences after it need for their real tokens (drafts aside),
        which a draft of sequence i may not take. (Preemptions only shorten the list's tail: a stale entry
        over-reserves, dropping a draft, never a real token.)"""
        need = [self.bm.num_new_blocks(s, s.num_uncomputed - len(s.draft_token_ids)) for s in self.running]
        suffix, total = [0] * len(need), 0
        for i in range(len(need) - 1, -1, -1):
            suffix[i], total = total, total + need[i]
        return suffix

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_prefix_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not self.fits_in_cache(seq.num_tokens):
                self.finish(seq, "error")
                batch.failed.append(seq)
                continue
            n = self._try_place(seq, budget)
            if n == 0:
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            batch.add(seq, n, admitted=True)
            budget -= n

    def _try_place(self, seq: Sequence, budget: int) -> int:
        """Match its prefix and reserve blocks for its first chunk; 0 (and no side effects) if
        the blocks do not fit. The watermark only applies when others run: alone, a sequence that
        fits the cache must always be admitted, or nothing would ever make progress."""
        self.bm.match_prefix(seq)
        n = min(seq.num_uncomputed, budget)
        reserve = self.watermark_blocks if self.running else 0
        if not self._fits(seq, n, reserve):
            self.bm.cancel_admission(seq)
            return 0
        self.bm.append(seq, n)
        self._register_ahead(seq, n)
        return n

    def _fits(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """`can_append`, once idle blocks have given way if need be (`reclaim`)."""
        while not self.bm.can_append(seq, num_new_tokens, reserve):
            if not self.reclaim():
                return False
        return True

    def _register_ahead(self, seq: Sequence, n: int) -> None:
        """Hash the blocks this step's `n` tokens of `seq` fill, now, so a sequence admitted after it in
        this step shares them (the step writes all KV before attention reads any). Not the draft's: the
        model may reject it, and its blocks' KV would then be for other tokens."""
        self.bm.register_full_blocks(seq, min(seq.num_computed_tokens + n, seq.num_tokens))

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> int:
        """Account for a finished device step: `sampled` maps seq_id -> token for sampling items.
        Items whose sequence was aborted or finished in the meantime are skipped. Returns the number of
        tokens appended."""
        self.advance(batch)
        return self.record(batch, sampled)

    def advance(self, batch: ScheduledBatch) -> None:
        """The first half of `update`, which needs no sampled token: the batch's new tokens count as
        computed and blocks they fill are hashed for the prefix cache. The engine calls it as soon as
        the step is dispatched, so a decode call can follow before the step's tokens are read."""
        batch.advanced = True
        for item in batch.items:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING:
                # a draft counts once confirmed (LLMEngine._accept_drafts): its KV may be for other tokens
                seq.num_computed_tokens += item.num_new_tokens - len(seq.draft_token_ids)
                self.bm.register_full_blocks(seq)

    def record(self, batch: ScheduledBatch, sampled: dict[int, int]) -> int:
        """The second half of `update`: append each sampling item's token (NO_TOKEN, the sampler's "nothing
        could be sampled", is no token: the engine ends that request). Returns the number appended (generated
        output: a pooling sequence's token is not)."""
        appended = 0
        for item in batch.items:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING and item.samples and sampled.get(seq.seq_id, NO_TOKEN) != NO_TOKEN:
                seq.output_token_ids.append(sampled[seq.seq_id])
                appended += not seq.pooling
        return appended

    def discard(self, batch: ScheduledBatch) -> None:
        """Make a step that failed (raised, or never reached the device) harmless: its blocks may hold no KV.
        Their hashes are forgotten, so no later request matches them; a sequence that reads one of them as
        computed (a same-step sharer, or any item once `advance` ran) recomputes: one admitted in this step
        goes back to the front of the queue as if never admitted (its lookup uncounted), one already running
        is preempted. The others keep their blocks and take the same tokens next step."""
        bs = self.bm.block_size
        written = {b for it in batch.items
                   for b in it.seq.block_table[it.start_pos // bs:-(-(it.start_pos + it.num_new_tokens) // bs)]}
        forgotten = self.bm.forget_hashes(written)
        for item in reversed(batch.items):  # the newest first: appendleft restores the queue's order
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING or not (batch.advanced or self._reads(seq, forgotten)):
                continue
            if item.admitted:
                self.running.remove(seq)
                self.bm.cancel_admission(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            else:
                self._preempt(seq, batch)

    def _reads(self, seq: Sequence, blocks: set[int]) -> bool:
        """Whether `seq` counts one of `blocks` as wholly computed (its attention would read it)."""
        bs = self.bm.block_size
        return any(b in blocks for b in seq.block_table[:seq.num_computed_tokens // bs])
