"""Request bodies of the HTTP API (pydantic, strict: `"5"` is not an int and `true` is not a number) and their
mapping onto the engine's SamplingParams. Field names and defaults follow OpenAI's API (with vLLM's extensions
`top_k`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `skip_special_tokens`, `include_stop_str_in_output`,
`bad_words`, `add_generation_prompt`, `continue_final_message`); LMDeploy's own bodies are in
lmjax.serve.lmdeploy_protocol. `logit_bias` is OpenAI's map of token ids (as strings) to biases in [-100, 100].
Unknown fields are ignored, as OpenAI does; OpenAI fields lmjax does not honour (best_of > n, suffix, non-text
content parts, the deprecated functions) are a 400 that names them unless left at their
no-op values. vLLM's prompt_logprobs are given (not with streaming, as vLLM). `tools` are rendered into the
prompt and, on a server started with --tool-call-parser, the reply is parsed for calls
(lmjax.serve.tool_parsers); tool_choice "required" or a named function guides the reply to the call's JSON
instead. Structured outputs: response_format (OpenAI's json_object / json_schema, LMDeploy's regex_schema,
vLLM's structural_tag), vLLM's guided_json / guided_regex / guided_choice / guided_grammar / structural_tag and
structured_outputs. An explicit `null` is the field's
default (`_Nullable`). Every string must be valid UTF-8: JSON can carry a lone surrogate (`"\\udc80"`), which no
tokenizer takes (`_Strict._utf8`). Out-of-range values are caught by SamplingParams / GenerationConfig, whose
ValueError names the value. Responses are plain dicts built in `responses.py`."""
from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from lmjax.config import SamplingParams
from lmjax.guided_params import GuidedDecodingParams, as_guided, from_response_format
from lmjax.serve.protocol_base import INT64, ChatMessage, StreamOptions, Tool, _Nullable
from lmjax.serve.tool_parsers import ForcedToolParser, SingleCall, ToolParser, forced_tool_schema


# Sampling fields whose default, when a request leaves them out, is the model's (vLLM's server does so).
MODEL_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_continue(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's one rule on the two switches (the last message may be anyone's: the template leaves it open)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def _max_tokens(requested: int | None, model: int | None, limit: bool) -> int | None:
    """vLLM's get_max_tokens: the model's max_new_tokens when the request gives none; with `limit` also the
    most it may ask for. (None: up to the context.)"""
    if requested is None or model is None:
        return model if requested is None else requested
    return min(requested, model) if limit else requested


class _Sampling(_Nullable):
    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(None, **INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's
    cache_salt: str | None = None  # vLLM's: other salts never share prefix-cache blocks
    logit_bias: dict | None = None  # OpenAI's {"token id": bias in [-100, 100]} (`_logit_bias`)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:{id}" (no text to decode)
    # Structured outputs (lmjax.engine.guided): OpenAI's / LMDeploy's response_format, vLLM's guided_* fields
    # and its newer structured_outputs; at most one of them.
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # vLLM's grammar: EBNF (GBNF) or Lark
    structural_tag: str | None = None  # vLLM's structural tags (JSON text)
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict | None = None
    # vLLM's: each prompt token's logprob and this many top ones ({id: {logprob, rank, decoded_token}}); -1: all
    prompt_logprobs: int | None = None
    priority: int = 0  # vLLM's: any but 0 needs its --scheduling-policy priority, which lmjax lacks
    request_id: str | None = None  # vLLM's: the response id's tail when no X-Request-Id header names one

    def _unsupported(self) -> dict:
        """{field: value} of the fields set to something lmjax does not do (accepted at their no-op values only,
        since ignoring them would hand back, say, free text where a tool call was asked for)."""
        return {}

    def _checked_prompt_logprobs(self) -> int | None:
        """vLLM's rules: -1 or >= 0, and not with streaming (the response's field comes whole)."""
        k = self.prompt_logprobs
        if k is not None and k < -1:
            raise ValueError(f"prompt_logprobs must be -1 (the whole vocabulary) or >= 0, got {k}")
        if k is not None and self.stream:
            raise ValueError(f"prompt_logprobs={k} is not available with stream=true")
        return k

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                defaults: dict | None = None, limit_max_tokens: bool = False) -> SamplingParams:
        """SamplingParams of this request; raises ValueError (-> HTTP 400) for out-of-range values. As in
        vLLM, a sampling field the request leaves out takes `defaults` (the model's generation_config), its
        max_new_tokens too when the request gives no max_tokens; with `limit_max_tokens` (vLLM's
        `--generation-config DIR`) that max_new_tokens also caps a request's own max_tokens."""
        bad = self._unsupported()
        if bad:
            raise ValueError(f"not supported by lmjax: {', '.join(f'{k}={v!r}' for k, v in bad.items())}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if self.stream_options is not None and not self.stream:  # as vLLM: a likely client mistake
            raise ValueError("stream_options can only be given with stream=true")
        if self.priority != 0:  # vLLM's words (its engine refuses it without --scheduling-policy priority)
            raise ValueError(f"Got priority {self.priority} but Priority scheduling is not enabled.")
        defaults = defaults or {}
        max_tokens = _max_tokens(max_tokens, defaults.get("max_tokens"), limit_max_tokens)
        chosen = {name: getattr(self, name) if name in self.model_fields_set
                  else defaults.get(name, getattr(self, name)) for name in MODEL_DEFAULTABLE}
        return SamplingParams(n=self.n, **chosen, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              ignore_eos=self.ignore_eos,
                              max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output, bad_words=self.bad_words,
                              allowed_token_ids=self.allowed_token_ids, logit_bias=self._logit_bias(),
                              guided_decoding=self._guide(), cache_salt=self.cache_salt)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} as SamplingParams' {id: bias} (empty: None). A key that is not an integer,
        or a bias outside OpenAI's [-100, 100], is a ValueError (-> 400) naming it; vLLM clamps the bias instead.
        Ids outside the vocabulary are the engine's to name (LLMEngine.validate_request)."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not re.fullmatch(r"-?[0-9]+", key):
                raise ValueError(f"logit_bias key {key!r} is not a token id (an integer, as a string)")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{key!r}]={bias!r} must be a number in [-100, 100]")
            out[int(key)] = float(bias)
        return out or None

    def _guides(self) -> dict:
        """{field: GuidedDecodingParams} of every structured-output field the request sets."""
        guides = {"response_format": from_response_format(self.response_format, self.guided_whitespace_pattern),
                  "structured_outputs": as_guided(self.structured_outputs)}
        kinds = ("json", "regex", "choice", "grammar")
        vllm = [f"guided_{k}" for k in kinds if getattr(self, f"guided_{k}") is not None]
        vllm += ["structural_tag"] if self.structural_tag is not None else []
        guides[" / ".join(vllm)] = GuidedDecodingParams.from_optional(
            json=self.guided_json, regex=self.guided_regex, choice=self.guided_choice, grammar=self.guided_grammar,
            whitespace_pattern=self.guided_whitespace_pattern, backend=self.guided_decoding_backend,
            structural_tag=self.structural_tag)
        return {k: v for k, v in guides.items() if v is not None}

    def _guide(self) -> GuidedDecodingParams | None:
        guides = self._guides()
        if len(guides) > 1:
            raise ValueError(f"give one kind of structured output, got {', '.join(guides)}")
        return next(iter(guides.values()), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None  # "auto" (default), "none", "required" or a named function
    parallel_tool_calls: bool | None = None  # false: at most one call (OpenAI's; vLLM keeps the first)
    functions: list | None = None
    function_call: str | dict | None = None
    # vLLM's chat template switches: continue_final_message renders the last (assistant) message open,
    # for the model to go on with it ("prefill")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: a Jinja template for this request
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the template (enable_thinking)
    documents: list[dict[str, Any]] | None = None  # vLLM's: for a RAG template (its `documents` variable)
    add_special_tokens: bool = False  # vLLM's: true tokenizes the rendered prompt with BOS etc. added
    echo: bool = False  # vLLM's: the reply starts with the last message's text when it is the reply's role's

    def _unsupported(self) -> dict:
        bad = super()._unsupported()
        if self.functions:  # OpenAI's deprecated form of tools
            bad["functions"] = f"[{len(self.functions)} function(s)] (send them as tools)"
        if self.function_call not in (None, "none", "auto"):
            bad["function_call"] = self.function_call
        return bad

    def sampling_params(self, defaults: dict | None = None, limit_max_tokens: bool = False) -> SamplingParams:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:  # named as the client sent it
            raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                            self._checked_prompt_logprobs(), defaults, limit_max_tokens)

    def message_dicts(self) -> list[dict]:
        return [m.to_dict() for m in self.messages]

    def template_kwargs(self) -> dict:
        """What the chat template gets beyond the messages and switches (vLLM's chat_template_kwargs, and the
        request's own chat_template)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return {**kwargs, "chat_template": self.chat_template} if self.chat_template else kwargs

    def tool_dicts(self) -> list[dict] | None:
        """The tools for the chat template (None without any): rendered also with tool_choice "none", as
        vLLM does."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced_function(self) -> tuple[bool, str | None]:
        """(forced, name): tool_choice "required" -> (True, None), a named function -> (True, its name),
        else (False, None). ValueError (-> 400) for a choice that names nothing among the tools."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return False, None
        if not self.tools:
            raise ValueError(f"tool_choice={choice!r} needs tools")
        if choice == "required":
            return True, None
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if name not in [t.function.name for t in self.tools]:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                             f"{[t.function.name for t in self.tools]}")
        return True, name

    def _guide(self) -> GuidedDecodingParams | None:
        """A forced tool choice guides the reply to the call's JSON (tool_parsers.forced_tool_schema), as
        vLLM does; then no other structured output may be asked for."""
        forced, name = self.forced_function()
        if not forced:
            return super()._guide()
        other = self._guides()
        if other:
            raise ValueError(f"tool_choice={self.tool_choice!r} constrains the reply to a tool call: it cannot "
                             f"be combined with {', '.join(other)}")
        return GuidedDecodingParams(json=forced_tool_schema(self.tool_dicts(), name, self.parallel_tool_calls is False),
                                    whitespace_pattern=self.guided_whitespace_pattern)

    def tool_call_parser(self, server_parser: ToolParser | None) -> ToolParser | None:
        """What the reply is parsed with: for tool_choice "auto" (or unset) with tools, the server's parser
        (ValueError -> 400 without one: vLLM's rule); for "required" or a named function, the guided JSON's
        own (ForcedToolParser, no server parser needed, as in vLLM); else None (plain content)."""
        forced, name = self.forced_function()
        if forced:
            return self._single(ForcedToolParser(name))
        if not self.tools or self.tool_choice == "none":
            return None
        if server_parser is None:
            raise ValueError(f"tools ({len(self.tools)} given) with tool_choice={self.tool_choice or 'auto'!r} need "
                             "a server started with --tool-call-parser NAME (and, in vLLM's spelling, "
                             "--enable-auto-tool-choice)")
        return self._single(server_parser)

    def _single(self, parser: ToolParser) -> ToolParser:
        return SingleCall(parser) if self.parallel_tool_calls is False else parser


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without BOS

    def _unsupported(self) -> dict:
        bad = super()._unsupported()
        if self.best_of is not None and self.best_of != self.n:  # best_of = n is plain sampling
            bad["best_of"] = self.best_of
        if self.suffix is not None:  # vLLM refuses any suffix, "" too
            bad["suffix"] = self.suffix
        return bad

    def sampling_params(self, defaults: dict | None = None, limit_max_tokens: bool = False) -> SamplingParams:
        """With echo and logprobs the prompt's tokens get log-probabilities too (OpenAI's legacy
        completions; lm-evaluation-harness scores continuations this way)."""
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        prompt_logprobs = self._checked_prompt_logprobs()
        if prompt_logprobs is None and self.echo:  # (as vLLM: echo scores the prompt at logprobs' width)
            prompt_logprobs = self.logprobs
        return self._params(1 if self.echo_only else self.max_tokens, self.logprobs, prompt_logprobs, defaults,
                            limit_max_tokens)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, OpenAI's legacy way to score a prompt;
        as vLLM, one token is generated and left out of the answer."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


CHAT_FIELDS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
               "chat_template_kwargs", "add_special_tokens")


def chat_request(body) -> ChatCompletionRequest:
    """The chat request whose prompt another route's `messages` form renders (/tokenize's, /v1/embeddings'):
    the chat fields `body` has and sets, as /v1/chat/completions would take them."""
    fields = {f: v for f in CHAT_FIELDS if (v := getattr(body, f, None)) is not None}
    return ChatCompletionRequest(model=body.model or "", **fields)
