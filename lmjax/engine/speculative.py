"""Speculative decoding by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`, "prompt lookup
decoding"): no draft model. Before a step, each eligible decoding sequence looks for the most recent earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt and
output; the up to num_speculative_tokens tokens that followed it become its draft. The step computes the
sequence's last token and the draft in one pass (like a short prefill chunk) and samples every position as
plain decoding would sample it there; the draft stands as long as the sampled tokens equal it, and the first
sampled token that differs (or the one after a wholly confirmed draft) ends the step's tokens. So a step yields
1 to k + 1 tokens, and the output is exactly the non-speculative one, sampled requests included: with a draft
fixed in advance (one token, probability 1), accepting it with probability p(draft) and otherwise sampling p
without it (speculative sampling's rule) is the same as sampling p and keeping the draft token when it comes
up; and position j draws the noise plain decoding would draw for that token (seed, step), so a seeded request
gives the same tokens with speculation on or off.

Eligible: requests with nothing decided per token on the host or from the output so far (no penalties, guides,
logits processors or host outputs, multi-token bad words, pending min_tokens). With speculation on, a batch
holding an eligible request runs single steps (no multi-step decode calls), draft or not, so speculation pays
where a step is latency-bound (small batches on a GPU) and the text repeats its context (code edits,
extraction, summaries). The lookup reads each eligible sequence's whole context on the host every step: one
vectorized compare (0.01 ms at 4k tokens on this CPU) after gathering its ids into an array (0.27 ms at 4k).
"""
from __future__ import annotations

import numpy as np

from lmjax.engine.host_outputs import needs_host
from lmjax.layers.sampler import NO_TOKEN
from lmjax.speculative_config import SpeculativeConfig


def propose(token_ids: np.ndarray, config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to `limit` (<= num_speculative_tokens) draft tokens: those after the most recent earlier match of
    the sequence's last n tokens, for the largest n that matches; [] when nothing does. One vectorized pass
    finds where the last token occurs before it; longer matches are checked only there."""
    k = min(limit, config.num_speculative_tokens)
    L = len(token_ids)
    if k <= 0 or L < 2:
        return []
    ends = np.flatnonzero(token_ids[:L - 1] == token_ids[L - 1])  # where a match of the tail would end
    matched = {1: ends}
    for n in range(2, min(config.prompt_lookup_max, L - 1) + 1):  # grow the match one token back at a time
        prev = matched[n - 1]
        prev = prev[prev >= n - 1]
        matched[n] = prev[token_ids[prev - (n - 1)] == token_ids[L - n]]
        if not matched[n].size:
            break  # (no longer match: growing further would cost the host a pass per n for nothing)
    for n in range(max(matched), config.prompt_lookup_min - 1, -1):
        starts = matched[n] + 1
        if starts.size:
            # the most recent match with k tokens after it, else the earliest (most tokens after it)
            full = starts[starts + k <= L]
            start = int(full[-1] if full.size else starts[0])
            return token_ids[start:start + k].tolist()
    return []


def accepted(draft: list[int], targets: np.ndarray) -> int:
    """How many draft tokens the model confirms: targets[j] is the token it sampled (or chose greedily) after
    draft token j (targets[0] after the sequence's last real token), so draft[j] stands while it equals
    targets[j]."""
    a = 0
    while a < len(draft) and draft[a] == int(targets[a]):
        a += 1
    return a


def row_starts(batch) -> list[int]:
    """Each item's first sampled row in the step's output (rows are items' positions in order)."""
    starts, r = [], 0
    for it in batch.items:
        starts.append(r)
        r += it.num_rows
    return starts


class SpeculativeMixin:
    """The engine's side (mixed into LLMEngine: config, scheduler, blocks, `_by_seq`, `_postprocess`)."""

    num_drafts = 0  # drafts verified, over the engine's life (vLLM's spec-decode metrics: 1 + accepted / drafts
    num_draft_tokens = 0  # is the mean acceptance length), their tokens, and those accepted
    num_accepted_tokens = 0

    def _speculates(self, req, comp) -> bool:
        p = req.params
        return (not p.uses_penalties and not req.bad_words_ids and comp.guide is None
                and not needs_host(p) and len(comp.token_ids) >= p.min_tokens)

    def spec_stats(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens}

    def _propose_drafts(self) -> None:
        """Give each eligible decoding sequence its draft for the coming step (lmjax.engine.speculative)."""
        spec = self.config.speculative_config
        if spec is None:
            return
        for seq in self.scheduler.running:
            if seq.num_uncomputed != 1 or seq.seq_id not in self._by_seq:
                continue
            req, comp = self._by_seq[seq.seq_id]
            if self._speculates(req, comp):
                limit = min(req.max_tokens - len(comp.token_ids) - 1, self.session_len - seq.num_tokens)
                seq.draft_token_ids = propose(np.asarray(seq.token_ids), spec, limit) if limit > 0 else []

    def _accept_drafts(self, batch, out, starts: list[int], changed: dict) -> set[int]:
        """Apply the tokens of the items that verified a draft: the confirmed draft and the model's token after
        it, one at a time (stop conditions apply to each); returns their sequence ids."""
        done = set()
        for i, it in enumerate(batch.items):
            seq, draft = it.seq, it.seq.draft_token_ids
            if not draft or not it.samples:
                continue
            seq.draft_token_ids = []
            done.add(seq.seq_id)
            if seq.seq_id not in self._by_seq:
                continue  # aborted while the step ran
            r0 = starts[i]
            a = accepted(draft, out.token_ids[r0:r0 + len(draft) + 1])
            self.num_drafts += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += a
            req, comp = self._by_seq[seq.seq_id]
            for j in range(a + 1):
                if out.token_ids[r0 + j] != NO_TOKEN:  # (NO_TOKEN, "nothing could be sampled", ends it)
                    seq.output_token_ids.append(int(out.token_ids[r0 + j]))
                    seq.num_computed_tokens = seq.num_tokens - 1  # confirmed tokens' KV is in the cache
                    self.num_generated_tokens += 1
                    self.blocks.register_full_blocks(seq)  # (before a finish frees the blocks: the prefix cache)
                self._postprocess(req, comp, out, r0 + j)
                if comp.finished:
                    break
            changed[req.request_id] = req
        return done
