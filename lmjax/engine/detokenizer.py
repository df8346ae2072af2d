"""Incremental detokenization for streaming: token ids in, only the new text out (host side).

Decoding the whole output every step costs O(length) per token. Instead we decode a small
window: the tokens whose text was emitted last time (`prefix`) plus the tokens since, and emit
the part of the window's text that extends past the prefix's text. The window starts where the
previous emission started, so context-sensitive decoders (byte-level BPE merging bytes across
tokens, SentencePiece dropping the leading space of a sequence) see the same left context in
both decodes, and the difference is exactly the new text.

A byte-level BPE can split one character (CJK, emoji) across tokens; decoding half of it yields
U+FFFD. While the window's text ends in U+FFFD we emit nothing and wait for more tokens, so the
stream never carries broken characters. `flush()` at the end emits whatever is still held back, less
a character left unfinished at the very end (generation stopped inside it): its bytes never became text,
and vLLM and LMDeploy drop it too.

At the end, `text` (the concatenation of everything returned) equals
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` without that
trailing U+FFFD.
With `continue_prompt=True` the first window starts inside the prompt instead (as vLLM does), so
text reads as a continuation of the prompt: a SentencePiece tokenizer then keeps the leading
space of the first output word.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # enough left context for any leading-space / byte-merge decision


class IncrementalDetokenizer:
    """Per-request streaming detokenizer. `step(new_ids)` returns only the newly completed text."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, continue_prompt: bool = False):
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes without transformers' per-call Python (5x faster, and
        # this runs twice per token per request); its output is the same when no clean-up is asked for.
        # (spaces_between_special_tokens only matters to slow tokenizers.)
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if continue_prompt else []
        self._ids = context              # context tokens, then every output token
        self._prefix_offset = 0          # window start: where the last emitted chunk began
        self._read_offset = len(context)  # tokens before this have been emitted as text
        self.output_ids: list[int] = []
        self.text = ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is unfinished)."""
        self._ids.extend(new_token_ids)
        self.output_ids.extend(new_token_ids)
        prefix_text, window_text = self._window_texts()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(prefix_text):])

    def flush(self) -> str:
        """At the end of generation: emit what is held back, less an unfinished character at its end."""
        prefix_text, window_text = self._window_texts()
        held = window_text[len(prefix_text):] if len(window_text) > len(prefix_text) else ""
        return self._emit(held.rstrip(REPLACEMENT_CHAR))

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        emitted = self._read_offset - self._prefix_offset
        return self._decode(window[:emitted]), self._decode(window)

    def _emit(self, new_text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # No clean-up of tokenization spaces: it rewrites text across the window boundary
        # (" ." -> "."), which would make the window differences inconsistent.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens,
                                     clean_up_tokenization_spaces=False)
