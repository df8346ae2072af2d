"""What the OpenAI routes make of a request before the engine sees it: the names the model answers to, the
prompt's token ids (chat template or text, with vLLM's add_special_tokens), and the max_tokens the context
leaves room for. Split from openai_server.py."""
from __future__ import annotations

from lmjax.api.batch import encode_chat
from lmjax.api.engine_thread import GenOut
from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest, check_continue

# --max-tokens-overflow: "error" is vLLM's (and OpenAI's) 400; "cut" is LMDeploy's api_server's rule
OVERFLOW_CHOICES = ("error", "cut")


def accepted_names(name: str, aliases: tuple[str, ...] = ()) -> set[str]:
    """The `model` values a server of `name` answers to: a Hugging Face id (`org/model`, not a path) also by
    its short name, as the model resolver takes it (README: `SmolLM2-135M-Instruct`)."""
    names = {name, *aliases}
    return names | {a.split("/")[1] for a in aliases if a.count("/") == 1 and not a.startswith((".", "/", "~"))}


def chat_prompt(engine, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The request's prompt (text, ids), with vLLM's `chat_template_kwargs`, `documents` and per-request
    `chat_template` (a role-marker --chat-template has no use for them: a 400 names them). `tools` go to a
    Jinja template (it decides where; one that ignores them is the model's business, as in vLLM); a role-marker
    ChatTemplateConfig has no place for them and renders the messages alone. add_special_tokens=true (vLLM's)
    tokenizes the rendered text with the tokenizer's special tokens added, as /tokenize does for messages."""
    check_continue(req.continue_final_message, req.add_generation_prompt)
    template, tok = engine.chat_template, engine.tokenizer
    kwargs = {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message}
    kwargs.update(req.template_kwargs())  # as vLLM: chat_template_kwargs may set the switches too
    if req.tools and not template.has_markers and (kwargs.get("chat_template") or getattr(tok, "chat_template", None)):
        kwargs["tools"] = req.tool_dicts()
    text, ids = encode_chat(tok, req.message_dicts(), template, **kwargs)
    return (text, tok(text, add_special_tokens=True)["input_ids"]) if req.add_special_tokens else (text, ids)


def chat_role(req: ChatCompletionRequest) -> str:
    """The reply's role (vLLM's get_chat_request_role): "assistant" after a generation prompt, else the last
    message's own (the reply continues it)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_echo(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the last message's text, when that message's role is the reply's, for the reply to
    start with; else None."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == chat_role(req) else None


def completion_prompts(engine, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, ids) of each prompt: a text one with the tokenizer's special tokens (BOS) unless the
    request says add_special_tokens=false (vLLM's); token ids as they are."""
    def encoded(p: str) -> tuple[str, list[int]]:
        if req.add_special_tokens:
            return engine.encode(p, do_preprocess=False)
        return p, engine.tokenizer(p, add_special_tokens=False)["input_ids"]
    return [encoded(p) if isinstance(p, str) else (None, list(p)) for p in req.prompts()]


def fitted(session_len: int, ids: list[int], params, requested: int | None, overflow: str = "error"):
    """The prompt's params, its max_tokens within the room the context leaves. A max_tokens the request asked
    for and the context cannot hold is a 400 (ValueError) with overflow "error", as in vLLM and OpenAI; with
    "cut" (LMDeploy's api_server) it is cut to the room left, and None means no room at all (LMDeploy answers
    an empty reply, `no_room`). One that came from the model's generation_config is always cut (vLLM's
    get_max_tokens)."""
    room = session_len - len(ids)
    if overflow == "cut" and room <= 0:
        return None
    if requested is not None and requested > room and overflow != "cut":
        raise ValueError(f"max_tokens={requested} is too large: this model's maximum context length is "
                         f"{session_len} tokens and the request has {len(ids)} input tokens")
    if params.max_tokens is not None and 1 <= room < params.max_tokens:
        params = params.clone()
        params.max_tokens = room
    return params


async def no_room(ids: list[int], params):
    """LMDeploy's answer to a prompt that leaves no room in the session: each completion empty, finish_reason
    "length", with the prompt's tokens counted."""
    for i in range(params.n):
        yield GenOut("", 0, len(ids), 0, "length", index=i, logprobs=None if params.logprobs is None else [])
