"""One request as the host bookkeeping sees it.

A `Sequence` is a prompt plus the tokens generated so far. The scheduler moves it between the waiting
queue and the running list; the block manager gives it a block table (its pages of the KV cache).
`num_computed_tokens` counts the leading tokens whose KV already sits in the cache, so the next step
has to compute `token_ids[num_computed_tokens:]`. Tokens are append-only, which is what makes the
chained block hashes in `block_hashes` valid for the whole life of the sequence (even across a
preemption, when the KV is thrown away and recomputed).

Plain Python only: this module is imported by the scheduler tests without jax or numpy.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """A request's tokens and its place in the cache.

    `params` is opaque here (the engine's sampling params). `arrival` orders sequences for scheduling
    and preemption; it defaults to a process-wide counter so creation order is arrival order.
    `eq=False` keeps identity semantics: two requests with equal tokens are still two sequences.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: Any = None
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_prefix_cached_tokens: int = 0
    num_prefix_queried: int = 0  # the tokens its admission's prefix lookup counted (cancel_admission takes them back)
    # The prefix-cache hit of its first admission (vLLM's num_cached_tokens: a recompute after a preemption
    # re-hits blocks it computed itself, which were no cache hit of the request)
    num_first_cached_tokens: int = 0
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    pooling: bool = False  # an embedding's: its one sampled token is no generated output (not counted)
    # Chained hashes of the full blocks of tokens seen so far; a cache owned by the BlockManager.
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # What a block's KV depends on besides the tokens before it (the root of the hash chain; vLLM's
    # `cache_salt`): blocks of sequences with different salts are never shared.
    cache_salt: Any = None
    # Tokens proposed after the real ones for the next step only (lmjax.engine.speculative): computed with them,
    # kept only as far as the model confirms them.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {self.seq_id} has an empty prompt")
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output, a new list (O(n): avoid on the per-step path, use `token_slice`)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next step should compute: the real ones not in the cache, and any draft."""
        return self.num_tokens + len(self.draft_token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` without concatenating the whole prompt and output; positions past the real
        tokens read the draft."""
        if end > self.num_tokens and self.draft_token_ids:
            n = self.num_tokens
            return self.token_slice(start, n) + self.draft_token_ids[max(0, start - n):end - n]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
