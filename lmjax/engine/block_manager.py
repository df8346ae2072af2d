"""Paged KV cache bookkeeping: which cache block holds which tokens of which sequence.

The cache is `num_blocks` blocks of `block_size` token slots. Block 0 is the padding sink: the device
step writes its padding tokens there, so it is never handed out. A sequence's `block_table[i]` holds
its tokens `[i * block_size, (i + 1) * block_size)`; `slot(seq, pos)` is the flat slot index the step
writes the KV of position `pos` to.

Prefix caching (optional): once a block is full its content never changes, so it is named by a hash
chained from its parent block's hash and its own token ids (the chain pins the absolute positions and
the whole prefix). A new sequence looks its full prompt blocks up by hash and shares the ones found
(reference counts), skipping their computation. Only full blocks are shared, and a sequence only ever
writes at positions >= its `num_computed_tokens`, which lie past its shared blocks: two sequences never
write into one block. A freed block keeps its hash and stays matchable until the allocator needs it:
allocation takes never-hashed free blocks first, then evicts the least recently freed hashed ones.

When blocks are hashed (`register_full_blocks`): as the scheduler allocates them for a step that will fill
them with tokens the host knows (prompt tokens, outputs already read back; never a speculative draft), as
vLLM V1 does, so a sequence admitted later in the same step shares them. That is sound because the device
step writes every token's KV into the paged cache before any sequence's attention reads the cache (each
layer: the KV write, then attention over block tables only; lmjax.layers.attention). Blocks that decoding
fills are hashed after the step that computed them (`Scheduler.advance`). A step that fails before its KV
is written must take its hashes back (`forget_hashes`, from `Scheduler.discard`).

Plain Python only (no jax, no numpy).
"""
from __future__ import annotations

from collections import OrderedDict, deque

from lmjax.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the reserved padding sink)")
        if block_size < 1:
            raise ValueError(f"{block_size=} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free_plain: deque[int] = deque(range(1, num_blocks))  # free, no hash
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, hashed; oldest first
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # A preempted sequence's readmission lookups, apart (vLLM's preempted_queries / preempted_hits): its
        # recompute re-hitting blocks it computed itself would inflate the hit rate.
        self.preempted_queries = 0
        self.preempted_hits = 0

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (hashed free blocks count: they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still lacks to hold `num_new_tokens` more computed tokens."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, need - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether `append` would succeed while still leaving `reserve` blocks free."""
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks - reserve

    # ---- allocation -------------------------------------------------------------------------

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` so slots exist up to `num_computed_tokens + num_new_tokens`."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: seq {seq.seq_id} needs {n}, {self.num_free_blocks} free")
        for _ in range(n):
            seq.block_table.append(self._allocate())

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks are released first so they are evicted first:
        a prefix is worth more than the suffix hanging off it."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._release(block)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        bs = self.block_size
        return seq.block_table[position // bs] * bs + position % bs

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        """Slots of positions `start .. start + count - 1` (the tokens a step writes)."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def _allocate(self) -> int:
        if self._free_plain:
            block = self._free_plain.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        """A block nobody references: keep it matchable if it is the registered copy of its hash."""
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            self._free_cached[block] = None
        else:
            self.block_hash[block] = None
            self._free_plain.append(block)

    # ---- prefix caching ---------------------------------------------------------------------

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Hash `seq`'s full token blocks up to `num_full_blocks`; each block is hashed once per
        sequence lifetime (tokens are append-only), so this costs O(new tokens)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.cache_salt
            hashes.append(hash((parent, tuple(seq.token_slice(i * bs, (i + 1) * bs)))))

    def match_prefix(self, seq: Sequence) -> int:
        """Share the longest run of cached full blocks at the start of a fresh `seq`.

        At least one token is left uncomputed so the step still produces the logits to sample from.
        Sets `num_computed_tokens` and `num_prefix_cached_tokens`; returns the tokens served.
        """
        if seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"match_prefix needs a fresh sequence; seq {seq.seq_id} has cached tokens")
        seq.num_prefix_cached_tokens = seq.num_prefix_queried = 0
        if not self.enable_prefix_caching or _computes_whole_prompt(seq):
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        for h in seq.block_hashes[:max_blocks]:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = seq.num_prefix_cached_tokens = hit
        seq.num_prefix_queried = seq.num_tokens  # (a failed step may uncount it after a token was appended)
        if not seq.num_preemptions:
            seq.num_first_cached_tokens = hit
        self._count_lookup(seq, 1)
        return hit

    def _count_lookup(self, seq: Sequence, sign: int) -> None:
        if seq.num_preemptions:
            self.preempted_queries += sign * seq.num_prefix_queried
            self.preempted_hits += sign * seq.num_prefix_cached_tokens
        else:
            self.prefix_cache_queries += sign * seq.num_prefix_queried
            self.prefix_cache_hits += sign * seq.num_prefix_cached_tokens

    def cancel_admission(self, seq: Sequence) -> None:
        """Undo `match_prefix` (and any `append`) for a sequence that did not get admitted after
        all, so a retry next step does not count its lookup twice."""
        self._count_lookup(seq, -1)
        self.free(seq)
        seq.num_computed_tokens = seq.num_prefix_cached_tokens = seq.num_prefix_queried = 0
        if not seq.num_preemptions:
            seq.num_first_cached_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: between benchmark runs, after a weight
        change). Only while no sequence holds a block, as in vLLM: a running one would keep sharing blocks
        whose hashes are gone. Returns whether it was reset."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def register_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Record the hash of every full block of `seq`'s first `num_tokens` tokens (default: those computed).
        The scheduler passes the tokens a step it is scheduling will have computed: their KV is in the cache
        before any attention of that step reads it. Only tokens known on the host (<= `seq.num_tokens`)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        if num_tokens > seq.num_tokens:
            raise ValueError(f"seq {seq.seq_id}: {num_tokens=} includes tokens the host does not know "
                             f"({seq.num_tokens} known): a draft or an unread sample is never hashed")
        num_full = min(num_tokens // self.block_size, len(seq.block_table))
        self._extend_hashes(seq, num_full)
        first = num_full  # walk back over the not-yet-registered blocks: O(newly full blocks)
        while first > 0 and self.block_hash[seq.block_table[first - 1]] is None:
            first -= 1
        for i in range(first, num_full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            self.block_hash[block] = h
            # A twin computed concurrently keeps the first registration; this block still
            # carries the hash so the walk-back above stops at it.
            self.hash_to_block.setdefault(h, block)

    def forget_hashes(self, blocks) -> set[int]:
        """Unregister `blocks` (those a failed step was to write: their KV may never have been written), so
        no later lookup matches them; returns the ones that had a hash. Their holders must recompute them
        (`Scheduler.discard`); a free one goes back to the never-hashed free blocks."""
        forgotten = set()
        for block in blocks:
            h = self.block_hash[block]
            if h is None:
                continue
            forgotten.add(block)
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
            if block in self._free_cached:
                del self._free_cached[block]
                self._free_plain.append(block)
        return forgotten


def _computes_whole_prompt(seq: Sequence) -> bool:
    """A request for prompt logprobs (or every position's logits or hidden states) computes its whole prompt:
    a cached block has no logits to give."""
    p = getattr(seq, "params", None)
    return getattr(p, "prompt_logprobs", None) is not None or "all" in (
        getattr(p, "output_logits", None), getattr(p, "output_last_hidden_state", None))
