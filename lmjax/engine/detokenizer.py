"""Incremental detokenization for streaming: token ids in, only the new text out (host side).

Decoding the whole output every step costs O(length) per token. Instead we decode a small
window: the tokens whose text was emitted last time (`prefix`) plus the tokens since, and emit
the part of the window's text that extends past the prefix's text. The window starts where the
previous emission started, so context-sensitive decoders (byte-level BPE merging bytes across
tokens, SentencePiece dropping the leading space of a sequence) see the same left context in
both decodes, and the difference is exactly the new text.

A byte-level BPE can split one character (CJK, emoji) across tokens; decoding half of it yields
U+FFFD. While the window's text ends in U+FFFD we emit nothing and wait for more tokens, so the
stream never carries broken characters. `flush()` at the end emits whatever is still held back, unless
it ends in a character left unfinished (generation stopped inside it): then none of it, as vLLM and
LMDeploy never emit such a window.

Without prompt context (the default), at the end `text` (the concatenation of everything returned) equals
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`, less the text
of a last window that ends in U+FFFD.
With `continue_prompt=True` (the engine's mode, as vLLM and LMDeploy) the first window starts inside
the prompt: the prompt's last tokens are context whose text counts as emitted, so `text` = decode(prompt
tail + output) minus decode(prompt tail) and reads as a continuation of the prompt. A SentencePiece
tokenizer (Metaspace / Strip decoder: "▁Paris") then keeps the first output word's leading space
(" Paris."); byte-level BPE text is unchanged (its tokens carry their own spaces). Skipped special tokens
decode to nothing, as in a full decode: after a BOS-only prompt the first word's space is dropped as at
the start of any sequence ("Paris.", as vLLM), after "<|im_start|>assistant\n" the text goes on from
"assistant\n". The tail starts on a character (SentencePiece's byte fallback turns a whole run of byte
tokens into U+FFFD when it starts mid-character). A prompt that ends inside a character (a byte-level or
byte-fallback split) leaves that character's tokens unemitted: if the output's first tokens complete it,
the whole character starts the text (vLLM's DecodeStream does the same); if not, the prompt's broken bytes
are dropped, as `flush()` drops an unfinished character at the end: the text never starts with U+FFFD.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # enough left context for any leading-space / byte-merge decision
MAX_PROMPT_CONTEXT_TOKENS = 24  # as far back as vLLM looks for a prompt tail that starts on a character
MAX_UNFINISHED_TOKENS = 3  # a character has at most 4 bytes: at most 3 of them end a prompt unfinished


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
        found = self._prompt_context(prompt_token_ids) if continue_prompt else ([], 0)
        context, emitted = found or ([], 0)
        self._ids = context              # context tokens, then every output token
        self._prefix_offset = 0          # window start: where the last emitted chunk began
        self._read_offset = emitted      # tokens before this have been emitted as text
        # U+FFFD starting the first emission are bytes of a character the prompt left unfinished (or may be,
        # when no tail starts on a character), not output text: as many as those bytes decode to alone (an
        # output's own literal U+FFFD after them is text); all of them when no tail was found
        self._prompt_unfinished = None if found is None else _leading_replacements(self._decode(context[emitted:]))
        self.output_ids: list[int] = []
        self.text = ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is unfinished). Several tokens
        at once give the text they would give one at a time (a deferred catch-up equals a stream)."""
        marks = len(self._ids), len(self.output_ids)
        self._ids.extend(new_token_ids)
        self.output_ids.extend(new_token_ids)
        prefix_text, window_text = self._window_texts()
        new_text = window_text[len(prefix_text):]
        if len(new_token_ids) > 1 and REPLACEMENT_CHAR in new_text:
            # A byte-fallback run that is not valid UTF-8 decodes as a whole to U+FFFD for every byte, where
            # a stream's shorter windows keep its good characters ("/" of <0x2F><0x80>): go one at a time.
            del self._ids[marks[0]:], self.output_ids[marks[1]:]
            return "".join(self.step([t]) for t in new_token_ids)
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """At the end of generation: emit what is held back, unless it ends in an unfinished character:
        then none of it (vLLM's detokenizers never emit a window ending in U+FFFD, so a last token holding a
        space and half an emoji adds nothing, not the space; LMDeploy's the same)."""
        prefix_text, window_text = self._window_texts()
        held = window_text[len(prefix_text):] if len(window_text) > len(prefix_text) else ""
        return self._emit("" if held.endswith(REPLACEMENT_CHAR) else held)

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        emitted = self._read_offset - self._prefix_offset
        return self._decode(window[:emitted]), self._decode(window)

    def _emit(self, new_text: str) -> str:
        if self._prompt_unfinished != 0:  # the output did not complete the prompt's last character: not its text
            cut = _leading_replacements(new_text)
            new_text, self._prompt_unfinished = new_text[min(cut, self._prompt_unfinished or cut):], 0
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new_text
        return new_text

    def _prompt_context(self, prompt_ids: Sequence[int]) -> tuple[list[int], int] | None:
        """The prompt's tail that the output continues, and how many of its tokens count as emitted: the
        tail's text must start on a character (a window that starts mid-character decodes wrongly: byte
        fallback turns a whole run of byte tokens into U+FFFD), so it grows from PROMPT_CONTEXT_TOKENS up
        to MAX_PROMPT_CONTEXT_TOKENS; the last 1-3 tokens of a character the prompt leaves unfinished are
        not emitted, so the output token that completes it emits the whole character. None: no such tail."""
        n = len(prompt_ids)
        for unfinished in range(min(MAX_UNFINISHED_TOKENS, n) + 1):
            for size in range(min(PROMPT_CONTEXT_TOKENS, n), min(MAX_PROMPT_CONTEXT_TOKENS, n) + 1):
                text = self._decode(list(prompt_ids[n - size:n - unfinished]))
                if (size == n or not text.startswith(REPLACEMENT_CHAR)) and not text.endswith(REPLACEMENT_CHAR):
                    return list(prompt_ids[n - size:]), size - unfinished  # (the prompt's start is a char's)
        return None

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


def _leading_replacements(text: str) -> int:
    return len(text) - len(text.lstrip(REPLACEMENT_CHAR))
