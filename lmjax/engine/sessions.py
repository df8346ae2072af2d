"""Interactive sessions (LMDeploy's `sequence_start` / `sequence_end`): a turn continues its session's tokens and,
when a batch slot is free, its KV blocks, so only the new tokens are prefilled; idle sessions' blocks give way
(least recently used first) before a running request would be preempted and before a waiting one is refused for
lack of blocks (Scheduler.reclaim), as LMDeploy evicts its hanging sequences first. Mixed into LLMEngine, whose
`sessions` (session id -> its finished Sequence) and `_session_of` (seq_id -> session id of a turn that keeps
its KV) it keeps."""
from __future__ import annotations

import bisect

from lmjax.config import SamplingParams
from lmjax.engine.request import Request
from lmjax.engine.sequence import SequenceStatus


class SessionsMixin:
    def add_session_request(self, session_id, prompt_token_ids: list[int], params: SamplingParams,
                            sequence_start: bool = True, sequence_end: bool = True, prompt: str | None = None,
                            request_id: str | None = None, step: int = 0) -> Request:
        """One turn of an interactive session (LMDeploy's semantics).

        `sequence_start=False` appends `prompt_token_ids` to the session's tokens (its previous turns, their
        outputs included) and reuses their KV cache: only the new tokens are prefilled. `sequence_end=False`
        keeps this turn's tokens and KV blocks for the next turn (until `end_session`); True ends the session.
        The whole session is bounded by session_len, like any prompt. `step` > 0 (LMDeploy's KV offset) continues
        after the history's first `step` tokens instead, dropping the rest (a rewind: e.g. to regenerate a reply).
        """
        if params.n != 1:
            raise ValueError(f"a session turn generates one completion, got n={params.n}")
        if session_id in self._session_of.values():  # both turns would keep their KV under one id: one leaks
            raise ValueError(f"session {session_id} is busy with another turn (end or abort it first)")
        kept = None if sequence_start else self.sessions.get(session_id)
        if not sequence_start and kept is None:
            raise ValueError(f"session {session_id} has no history: start it with sequence_start=True")
        history = _rewound(kept.token_ids if kept is not None else [], step, session_id)
        req = self.add_request(history + list(prompt_token_ids), params, prompt, request_id)  # validates first
        if kept is None:
            self.end_session(session_id)  # a new start drops any earlier history
        else:
            del self.sessions[session_id]  # this turn owns the history now
        seq, s = req.completions[0].seq, self.scheduler
        # The kept KV serves only the prompt it was computed for: not after truncate_prompt_tokens cut the
        # history's start, nor for prompt logprobs (the cache holds no logits): then the turn recomputes.
        untruncated = len(req.prompt_token_ids) == len(history) + len(prompt_token_ids)
        # A rewind recomputes too: a kept block past `step` may be in the prefix cache under its old tokens
        # Dynamic NTK: the kept keys were rotated with the base of the earlier, shorter prompt (cache_salt)
        reusable = untruncated and params.prompt_logprobs is None and kept is not None \
            and len(history) == len(kept.token_ids) and kept.cache_salt == seq.cache_salt
        if kept is not None and kept.block_table and reusable and s.num_running < s.max_batch_size:
            s.waiting.remove(seq)  # resume it as running, its first num_computed_tokens already in the cache
            seq.block_table, kept.block_table = kept.block_table, []
            seq.num_computed_tokens = req.num_cached_tokens = kept.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(s.running, seq, key=lambda q: q.arrival)
        elif kept is not None:
            self.blocks.free(kept)  # no batch slot to resume into: recompute (prefix caching may still hit)
        if not sequence_end:
            self._session_of[seq.seq_id] = session_id
        return req

    def end_session(self, session_id) -> None:
        """Forget a session's history and free its KV blocks (a running turn is not touched)."""
        seq = self.sessions.pop(session_id, None)
        if seq is not None:
            self.blocks.free(seq)

    def _evict_idle_session(self) -> bool:
        """Free the KV blocks of the least recently used idle session (its tokens stay: a later turn
        recomputes them). Returns False when no idle session holds blocks."""
        for seq in self.sessions.values():
            if seq.block_table:
                self.blocks.free(seq)
                return True
        return False


def _rewound(history: list[int], step: int, session_id) -> list[int]:
    """The history a turn continues: all of it (step 0), or its first `step` tokens."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= len(history):
        raise ValueError(f"step={step!r} must be an int from 0 to the {len(history)} tokens session {session_id} "
                         "holds (0: after all of them)")
    return history[:step] if step else history
