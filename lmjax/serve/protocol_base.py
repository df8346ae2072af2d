"""The strict, null-is-default base of the HTTP API's request bodies (lmjax.serve.protocol) and the pieces of a
chat request (messages, tools): split from protocol.py, which re-exports them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lmjax.loader.tokenizer import text_content

INT64 = dict(ge=-2**63, le=2**63 - 1)  # seeds: what vLLM accepts (a wider int would wrap onto another seed)
NULL_IS_NONE = frozenset({"max_tokens"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _utf8(cls, value):
        """A 400 naming the field, rather than the tokenizer's cryptic TypeError deep in the request."""
        bad = _lone_surrogate(value)
        if bad is not None:
            raise ValueError(f"is not valid UTF-8: it holds the lone surrogate {bad!r}")
        return value


def _lone_surrogate(value) -> str | None:
    """The first character of `value` (a str, or one inside lists and dicts) that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value[e.start]
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((bad for v in items if (bad := _lone_surrogate(v)) is not None), None)


class _Nullable(_Strict):
    """OpenAI's optional fields are nullable: an explicit `null` means the default (openai-python sends
    `"temperature": null` for an option passed as None). `_NULL_IS_NONE` keeps null as None where None
    means something of its own (max_tokens: no limit but the context, as in vLLM)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in NULL_IS_NONE}


class StreamOptions(_Strict):  # vLLM's defaults: a stream_options given asks for the usage chunk
    include_usage: bool = True
    continuous_usage_stats: bool = False  # (vLLM's) the usage so far in every chunk too


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of a request's `tools`: only functions exist in OpenAI's chat API."""
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(_Strict):
    name: str
    arguments: str | dict  # OpenAI sends a JSON string; the template gets a dict (render_chat)


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant message, sent back in the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls (its content may be null)
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list joined by newlines (other
        parts are a ValueError, `lmjax.loader.tokenizer.text_content`)."""
        return text_content(self.content, f"a {self.role} message") or ""

    def to_dict(self) -> dict:
        """What the chat template gets: role and text, and the tool fields where set."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        out.update({k: getattr(self, k) for k in ("name", "tool_call_id") if getattr(self, k) is not None})
        return out
