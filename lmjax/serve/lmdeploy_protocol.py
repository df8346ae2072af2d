"""LMDeploy's own request bodies: `/v1/encode` (EncodeRequest) and `/v1/chat/interactive` (InteractiveRequest,
LMDeploy's GenerateRequest), in the strict, null-is-default style of lmjax.serve.protocol."""
from __future__ import annotations

from pydantic import Field

from lmjax.config import GenerationConfig
from lmjax.serve.protocol_base import INT64, _Nullable


class EncodeRequest(_Nullable):
    """LMDeploy's `/v1/encode` body: `do_preprocess` puts each input through the chat template first;
    `add_bos` says the input starts a conversation (else it is tokenized as a later turn, without BOS)."""

    input: str | list[str]
    do_preprocess: bool = False
    add_bos: bool = True

    def inputs(self) -> list[str]:
        """One entry per input; an empty list is a ValueError (it would answer lists of nothing)."""
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise ValueError("input=[] is empty: give a string or a list of strings")
        return self.input


class InteractiveRequest(_Nullable):
    """LMDeploy's `/v1/chat/interactive` body. With `interactive_mode` the session keeps its history
    (and KV cache) for the next request with the same `session_id`; without it the session ends."""

    prompt: str | list[dict]
    session_id: int = -1
    interactive_mode: bool = False
    stream: bool = False
    stop: str | list[str] | None = None
    request_output_len: int | None = None
    top_p: float = 0.8
    top_k: int = 40
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cancel: bool = False
    seed: int | None = Field(None, **INT64)
    min_new_tokens: int | None = None
    min_p: float = 0.0

    def gen_config(self) -> GenerationConfig:
        if self.request_output_len is not None and self.request_output_len < 1:
            raise ValueError(f"request_output_len must be at least 1, got {self.request_output_len}")
        return GenerationConfig(max_new_tokens=self.request_output_len, top_p=self.top_p, top_k=self.top_k,
                                temperature=self.temperature, repetition_penalty=self.repetition_penalty,
                                ignore_eos=self.ignore_eos, stop_words=self.stop, random_seed=self.seed,
                                skip_special_tokens=self.skip_special_tokens, min_p=self.min_p,
                                min_new_tokens=self.min_new_tokens,
                                spaces_between_special_tokens=self.spaces_between_special_tokens)
