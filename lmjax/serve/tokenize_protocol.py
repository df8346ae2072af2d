"""Bodies of vLLM's tokenizer endpoints, `POST /tokenize` and `POST /detokenize` (LMDeploy's `/v1/encode` is
in protocol.py): a prompt, or chat messages rendered by the chat template as /v1/chat/completions renders
them, into token ids; token ids back into text."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from lmjax.serve.protocol import chat_request
from lmjax.serve.protocol_base import ChatMessage, Tool, _Nullable


class TokenizeRequest(_Nullable):
    """Exactly one of `prompt` and `messages`. add_special_tokens: vLLM's default is true for a prompt and
    false for messages (their template writes the special tokens itself)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's, as /v1/chat/completions takes them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None  # as /v1/chat/completions takes them (a RAG template's)
    return_token_strs: bool = False

    def token_ids(self, tokenizer, render_chat) -> list[int]:
        """render_chat(ChatCompletionRequest) -> (text, ids): the server's own chat rendering."""
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None:
            add = True if self.add_special_tokens is None else self.add_special_tokens
            return tokenizer(self.prompt, add_special_tokens=add)["input_ids"]
        return render_chat(chat_request(self))[1]


class DetokenizeRequest(_Nullable):
    model: str | None = None
    tokens: list[int]
