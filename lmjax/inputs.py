"""vLLM's prompt dicts (`vllm.inputs`, also `from vllm import TokensPrompt`): what `LLM.generate`, `LLM.chat`'s
neighbours and `LLMEngine.add_request` take besides a plain string. Type hints only: a plain dict with the same
keys is the same prompt. lmjax reads `prompt`, `prompt_token_ids` and `cache_salt`; vLLM's multimodal and
encoder-decoder keys are refused by name (lmjax's models read text only)."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only among prompts of the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from (as vLLM, only reported back)
    cache_salt: NotRequired[str]
