"""Tokenizer loading: a Hugging Face directory or the tokenizer (and chat template) embedded in a GGUF file.

`load_tokenizer(model_path, tokenizer_path=None)` picks the source in this order: `tokenizer_path` when
given, else `model_path`. A directory goes to `AutoTokenizer.from_pretrained(dir)`; when that directory
has no tokenizer files but holds exactly one `.gguf`, that file is used. A `.gguf` file goes to
`gguf_tokenizer` (transformers' own GGUF tokenizer converter fed by the `gguf` reader: the object
`AutoTokenizer.from_pretrained(dirname, gguf_file=basename)` builds, without its torch import and in a
third of its time; tests/loader/test_gguf_tokenizer.py holds the two equal). Results are cached per
resolved path since building a tokenizer from GGUF metadata takes seconds; the cached object is shared, so
do not mutate it.
"""
from __future__ import annotations

import functools
import glob
import json
import os

from lmjax.validation import check_text


class TokenizerLoadError(ValueError):
    """No tokenizer could be built from the given path (the message names it)."""


def _single_gguf_in(directory: str) -> str | None:
    files = glob.glob(os.path.join(directory, "*.gguf"))
    return files[0] if len(files) == 1 else None


def _has_tokenizer_files(directory: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(directory, n)) for n in names)


# tokenizer_class values for which AutoTokenizer builds transformers' plain fast tokenizer
# (PreTrainedTokenizerFast; named TokenizersBackend since transformers 5).
_PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def tokenizer_source(model_path: str, tokenizer_path: str | None = None) -> str:
    """The directory or .gguf file `load_tokenizer` will read, checked without reading it (milliseconds),
    so a checkpoint with no tokenizer fails before its weights load, not after. Errors name the path."""
    path = os.path.abspath(tokenizer_path or model_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    if os.path.isdir(path):
        if _has_tokenizer_files(path):
            return path
        if gguf := _single_gguf_in(path):
            return gguf
        raise TokenizerLoadError(f"could not load a tokenizer from {path}: no tokenizer.json, "
                                 "tokenizer_config.json, tokenizer.model or vocab.json, and not exactly one .gguf "
                                 "file (pass tokenizer=PATH for a tokenizer kept elsewhere)")
    if not path.endswith(".gguf"):
        raise TokenizerLoadError(f"could not load a tokenizer from {path}: expected a directory or a .gguf file")
    return path


@functools.lru_cache(maxsize=8)
def _load(path: str):
    try:
        if os.path.isdir(path) and _tokenizer_class(path) in _PLAIN_FAST_CLASSES:
            # What AutoTokenizer builds for this class, without AutoTokenizer's import of torch (seconds
            # on a slow host; on a second start the tokenizer is what the engine's start waits for).
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(path)
        if path.endswith(".gguf"):
            from lmjax.loader.gguf_tokenizer import gguf_tokenizer
            return gguf_tokenizer(path)
        if os.path.isdir(path):
            from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed
            return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types; the caller needs the path above all
        raise TokenizerLoadError(f"could not load a tokenizer from {path}: {type(e).__name__}: {e}") from e
    raise TokenizerLoadError(f"could not load a tokenizer from {path}: expected a directory or a .gguf file")


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """A transformers tokenizer for `tokenizer_path` (if given) or `model_path`."""
    return _load(tokenizer_source(model_path, tokenizer_path))


def text_content(content, where: str = "content") -> str | None:
    """A message's content as the string chat templates expect: a string or None as it is, OpenAI's list
    of content parts as its text parts joined by newlines (as vLLM does for string templates). Any other
    part (an image, audio) is a ValueError: the models served read text only, and dropping the part would
    answer a question that was not asked."""
    if not isinstance(content, list):
        return content if content is None else check_text(content, where)
    other = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content
             if not (isinstance(p, dict) and p.get("type") == "text")]
    if other:
        raise ValueError(f"{where}: content parts of type {other} are not supported: this model reads text only")
    for i, p in enumerate(content):
        if not isinstance(p.get("text", ""), str):
            raise ValueError(f"{where}[{i}].text must be a string, got {type(p['text']).__name__}")
    return check_text("\n".join(p.get("text", "") for p in content), where)


def check_messages(messages) -> None:
    """A ValueError naming the first message that is not a dict with a 'role' string and a 'content' that is a
    string, None or a list of content parts (`text_content`): what every chat template reads, checked before
    one fails on it with a KeyError or a jinja error that names no message."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' string, got {m!r}")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise ValueError(f"messages[{i}].content must be a string, a list of content parts or None, "
                             f"got {type(m['content']).__name__}")


MAX_PROMPT_CHARS = 8_000_000  # a rendered chat prompt's length: far past any context (128k tokens ~ 0.5M chars)


def render_chat(tokenizer, messages: list[dict], **kwargs):
    """`tokenizer.apply_chat_template(messages, **kwargs)` (kwargs may hold `tools`, OpenAI's tool list),
    with messages checked first (content parts made text, `text_content`; tool calls' JSON-string
    arguments decoded, `_with_dict_arguments`) and a template that fails on them turned into a
    ValueError naming the message: a jinja error such as "'dict object' has no attribute 'content'" says
    nothing of which message or field was wrong."""
    check_messages(messages)
    messages = [{**m, "content": text_content(m["content"], f"messages[{i}]")} if isinstance(m.get("content"), list)
                else m for i, m in enumerate(messages)]
    messages = [_with_dict_arguments(m, i) if m.get("tool_calls") else m for i, m in enumerate(messages)]
    import jinja2  # transformers' template engine

    try:
        out = tokenizer.apply_chat_template(messages, **kwargs)
    except jinja2.TemplateError as e:  # undefined fields, and raise_exception() calls inside templates
        hint = [i for i, m in enumerate(messages) if "content" not in m]
        where = f" (messages {hint} have no 'content')" if hint else ""
        raise ValueError(f"the chat template could not render these messages{where}: {e}") from e
    except (ArithmeticError, TypeError, ValueError, LookupError, MemoryError) as e:  # a (request's own) template's bug
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
    if isinstance(out, str) and len(out) > MAX_PROMPT_CHARS:  # a template that multiplies text ('x' * 10**8)
        raise ValueError(f"the chat template rendered {len(out):,} characters, more than the {MAX_PROMPT_CHARS:,} a "
                         "prompt may have")
    return out


def _with_dict_arguments(message: dict, i: int) -> dict:
    """An assistant message whose tool calls' `function.arguments` are decoded: OpenAI sends a JSON string,
    and templates (Llama 3.1's, Qwen2.5's, Hermes') render or iterate them as a mapping. As vLLM, the decoded
    value goes to the template whatever it is: a server returns '"Paris"', 'null' or '[1]' for a model that
    wrote such arguments (tool_parsers.arguments_text), and a client sends that message back. An empty
    string is {}; text that is not JSON is a ValueError naming the call and the text."""
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        args = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(args, str):
            try:
                value = json.loads(args) if args.strip() else {}
            except ValueError:
                shown = args if len(args) <= 200 else args[:200] + "..."  # (it may be a whole file)
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be JSON text (the "
                                 f"arguments' JSON string), got {shown!r}") from None
            call = {**call, "function": {**function, "arguments": value}}
        calls.append(call)
    return {**message, "tool_calls": calls}


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (transformers' own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def sentencepiece_byte(piece: str) -> int | None:
    """The byte a SentencePiece byte-fallback piece ("<0x0A>") stands for; None for any other piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return int(piece[3:5], 16)
    return None


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for, also when it holds part of a UTF-8 character (OpenAI's logprob
    `bytes`: joined over a reply they give its text; `decode([id])` gives U+FFFD for such a piece).
    Byte-level BPE pieces map through GPT-2's alphabet, SentencePiece byte pieces <0xNN> to their byte and
    other SentencePiece pieces to their text with "▁" as the space it stands for (`decode([id])` strips a
    leading one: "▁Paris" would lose its space); other tokens are their decoded text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str) and (byte := sentencepiece_byte(piece)) is not None:
        return bytes([byte])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    table = byte_level_decoder()
    if type(decoder).__name__ == "ByteLevel" and isinstance(piece, str) and all(c in table for c in piece) \
            and int(token_id) not in tokenizer.all_special_ids:
        return bytes(table[c] for c in piece)
    if isinstance(piece, str) and _SP_SPACE in piece and int(token_id) not in tokenizer.all_special_ids:
        return piece.replace(_SP_SPACE, " ").encode()
    return tokenizer.decode([int(token_id)]).encode()


_SP_SPACE = "\u2581"  # SentencePiece's word-boundary mark "▁"


def token_text(tokenizer, token_id: int) -> str:
    """One token's text as logprobs name it (OpenAI / vLLM): its bytes decoded, U+FFFD for part of a
    character; a SentencePiece word piece keeps its leading space, so a completion's tokens join to its text."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
