"""LMDeploy's ChatTemplateConfig: chat messages -> a prompt string, by role markers or through the tokenizer's
own (Jinja) chat template when only `model_name` is given. Re-exported by lmjax.config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmjax.validation import as_list as _as_list, check as _check, strict_fields as _strict_fields, warn_once


@_strict_fields
@dataclass
class ChatTemplateConfig:
    """LMDeploy's chat-template fields. With only `model_name` set, the tokenizer's own chat
    template is used (`meta_instruction` then its system message where the messages have none; without a
    template, LMDeploy's "base" template: the messages' text as is); with role
    markers, the prompt is built from them:
    [system meta_instruction eosys] then per message `<role marker> content <role end>`, then
    `assistant` to open the reply (LMDeploy's BaseChatTemplate layout).
    `stop_words` are added to each request's stop strings by the pipeline."""
    model_name: str | None = None
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    separator: str | None = None
    capability: str | None = None
    stop_words: list[str] | None = None

    def __post_init__(self):
        _check(self.capability in (None, "completion", "chat"),
               f"capability must be None, 'completion' or 'chat', got {self.capability!r}")
        self.stop_words = _as_list(self.stop_words, "stop_words", str)

    @property
    def has_markers(self) -> bool:
        return any(getattr(self, k) is not None for k in ("system", "user", "assistant", "eoh", "eoa"))

    def renders_jinja(self, messages, tokenizer, chat_template: str | None = None) -> bool:
        """Whether messages2prompt renders `messages` through a Jinja chat template (the request's own or the
        tokenizer's): its text then holds any BOS the model wants; role markers and plain text hold none."""
        if self.capability == "completion" and isinstance(messages, str):
            return False
        return not self.has_markers and tokenizer is not None and \
            bool(chat_template or getattr(tokenizer, "chat_template", None))

    def messages2prompt(self, messages: str | list[dict[str, Any]], tokenizer=None, *,
                        add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
                        **template_kwargs) -> str:
        """Prompt text for `messages` (a string is one user turn). add_generation_prompt: end with the
        assistant's opening; continue_final_message: leave the last (assistant) message open for the
        model to go on with (vLLM's / transformers' switches). Neither given: LMDeploy's rule, a last
        message of the assistant's is the start of the reply (continued), else a reply is opened.
        template_kwargs: for the tokenizer's Jinja template (vLLM's chat_template_kwargs, `tools`, a
        `chat_template` of the request's own); role markers have no use for them (a ValueError names them)."""
        if self.capability == "completion" and isinstance(messages, str):
            return messages
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if add_generation_prompt is None and continue_final_message is None:
            prefix = bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
            add_generation_prompt, continue_final_message = not prefix, prefix
        add_generation_prompt = True if add_generation_prompt is None else add_generation_prompt
        continue_final_message = bool(continue_final_message)
        if not self.renders_jinja(messages, tokenizer, template_kwargs.get("chat_template")):
            if template_kwargs:
                raise ValueError(f"{sorted(template_kwargs)} are for a Jinja chat template: this one renders "
                                 f"{'role markers' if self.has_markers else 'plain text'} "
                                 f"(ChatTemplateConfig(model_name={self.model_name!r}))")
            if not self.has_markers:  # LMDeploy's "base" template for a model without one: the text as is
                warn_once(f"no chat template (ChatTemplateConfig(model_name={self.model_name!r}) has no role "
                          "markers, the tokenizer none): messages are joined as plain text")
            return self._from_markers(messages, add_generation_prompt, continue_final_message)
        from lmjax.loader.tokenizer import render_chat  # config stays import-light for every layer

        extra = {"continue_final_message": True} if continue_final_message else {}  # older templates: not asked
        if self.meta_instruction is not None and not (messages and isinstance(messages[0], dict)
                                                      and messages[0].get("role") == "system"):
            # LMDeploy's meta_instruction is the template's system prompt where the messages bring none
            messages = [{"role": "system", "content": self.meta_instruction}, *messages]
        return render_chat(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra,
                           **template_kwargs)

    def _from_markers(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> str:
        from lmjax.loader.tokenizer import check_messages, text_content  # config stays import-light

        check_messages(messages)  # a message without a role: a ValueError naming it, not a KeyError
        s = lambda v: v or ""  # noqa: E731  (None markers render as nothing)
        opens = {"system": s(self.system), "user": s(self.user), "assistant": s(self.assistant)}
        ends = {"system": s(self.eosys), "user": s(self.eoh),
                "assistant": s(self.eoa) + s(self.separator)}
        prompt = ""
        if self.meta_instruction is not None and (not messages or messages[0]["role"] != "system"):
            prompt = f"{s(self.system)}{self.meta_instruction}{s(self.eosys)}"
        for i, m in enumerate(messages):
            if m["role"] not in opens:
                raise ValueError(f"unknown chat role {m['role']!r}; expected one of {list(opens)}")
            content = text_content(m.get("content"), f"messages[{i}]")
            open_last = continue_final_message and i == len(messages) - 1
            prompt += f"{opens[m['role']]}{content or ''}{'' if open_last else ends[m['role']]}"  # None: empty
        return prompt + (s(self.assistant) if add_generation_prompt and not continue_final_message else "")
