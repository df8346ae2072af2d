"""vLLM's LLMEngine names on lmjax's engine, for code that drives `LLM(...).llm_engine` as vLLM's (its
add_request / step signatures are lmjax's own: lmjax.LLMEngine has vLLM's). Mixed into LLMEngine."""
from __future__ import annotations

from collections.abc import Iterable

from lmjax.engine.guided import GuidedDecoding


class VLLMNamesMixin:
    def get_tokenizer(self):
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Requests from now on go through `tokenizer` (vLLM's LLM.set_tokenizer): its EOS joins the
        checkpoint's, guides compile against it; requests already running keep the one they started with."""
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = sorted(self.checkpoint_eos_ids | ({eos} if isinstance(eos, int) else set()))
        self.tokenizer_eos = eos  # the EOS whose stop_reason is None
        self.guided = GuidedDecoding(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def has_unfinished_requests(self) -> bool:
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """vLLM's: one id or several; ids not (or no longer) running are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.abort(rid)
