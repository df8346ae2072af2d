"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): each prompt token's logprob under the logits before
it, the top-k there and its rank, from the rows a step computes for the prompt (a request asking for them skips
prefix-cache hits: lmjax.engine.block_manager). Mixed into LLMEngine (its `_by_seq`)."""
from __future__ import annotations

from lmjax.engine.model_runner import StepOutput, bucket
from lmjax.engine.scheduler import ScheduledBatch


class PromptLogprobsMixin:
    def _prompt_logprobs_k(self, batch: ScheduledBatch) -> int:
        wanted = [self._by_seq[it.seq.seq_id][0].params.prompt_logprobs for it in batch.items
                  if it.start_pos < it.seq.num_prompt_tokens and it.seq.seq_id in self._by_seq]
        wanted = [k for k in wanted if k is not None]
        return (bucket(max(wanted), 1) if max(wanted) else 0) if wanted else -1

    def _record_prompt_logprobs(self, batch: ScheduledBatch, out: StepOutput) -> None:
        chosen_T, top_ids_TK, top_lp_TK, rank_T = out.prompt
        row = 0
        for it in batch.items:
            req = self._by_seq.get(it.seq.seq_id, (None,))[0]  # (None: it ended while the step ran)
            k = req.params.prompt_logprobs if req is not None else None
            for j in range(it.num_new_tokens):
                pos = it.start_pos + j + 1  # the prompt token this row predicts
                if k is not None and pos < len(req.prompt_token_ids) and req.prompt_logprobs[pos] is None:
                    entry = dict(zip(top_ids_TK[row + j, :k].tolist(), top_lp_TK[row + j, :k].tolist()))
                    entry[req.prompt_token_ids[pos]] = float(chosen_T[row + j])
                    req.prompt_logprobs[pos] = entry
                    req.prompt_ranks[pos] = int(rank_T[row + j])
            row += it.num_new_tokens
