"""Guides with llguidance, the library behind vLLM's "guidance" backend: a context-free grammar in EBNF
(llama.cpp's GBNF, which vLLM's xgrammar examples use) or in Lark syntax, structural tags (JSON arguments
constrained between a begin and end string once a trigger appears in free text: tool calls), and JSON schemas
and json_object (lmjax.engine.guided_json). Regexes and choices stay with outlines-core (lmjax.engine.guided);
both give the engine the same per-completion state (`mask_W`, `advance`).
A grammar's mask costs more host time than outlines' (SmolLM2, 49k vocabulary, one row: ~10-15 us a step for
JSON, ~0.1 ms for a GBNF grammar and 1-2 ms inside a GBNF character-class repeat such as [A-Za-z ]+, which
llguidance's converter turns into a repeat of one-character rules; the same in Lark as a terminal /[A-Za-z ]+/
is faster, and as a regex guide ~5 us).

The vocabulary llguidance walks is the one outlines walks (guided.vocabulary_map: each token id's bytes in the
tokenizer's own spelling, byte-level BPE or SentencePiece), so both kinds of guide read a first "▁Paris" as
b" Paris". llguidance also tokenizes the bytes a grammar forces (to fast-forward through them); it gets the
tokenizer's own ids where they spell exactly those bytes, else the longest tokens that do (`_ByteTokenizer`).

Shape letters: W 32-bit words of a packed token mask, ceil(V / 32) for the model's V logits.
"""
from __future__ import annotations

import json
import re

import numpy as np

from lmjax.engine.guided_json import json_grammar
from lmjax.layers.sampler import pack_token_ids
from lmjax.loader.tokenizer import sentencepiece_byte


# llguidance marks a special token's bytes with this first byte (no UTF-8 text holds it), so a grammar's text
# never matches one; `<|name|>` in a Lark grammar names it.
SPECIAL_PREFIX = b"\xff"
CALLBACK_CACHE_SIZE = 4096  # forced texts whose tokens are remembered (~110 us each on SmolLM2's tokenizer)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a core dependency, but an old install may lack it: say what to do
        raise ValueError("grammar-guided decoding needs the llguidance package: pip install 'llguidance>=1.0'") from e
    return llguidance


class _ByteTokenizer:
    """What llguidance.TokenizerWrapper reads: `tokens` (id -> bytes; special and unused ids marked with
    SPECIAL_PREFIX, so no text matches them, and named as the tokenizer names them: a grammar may say
    `<|im_end|>`; unused ids `<[id]>`), eos / bos ids, and a call that tokenizes bytes."""

    def __init__(self, tokenizer, vocab: dict[bytes, list[int]], num_ids: int, eos_id: int):
        self.tokens = [b""] * num_ids
        for data, ids in vocab.items():
            for i in ids:
                if i < num_ids:
                    self.tokens[i] = data
        self.special_token_ids = [i for i in range(num_ids) if not self.tokens[i]]
        self.special_names = _special_names(tokenizer, self.special_token_ids)  # {id: "<|im_end|>"}
        for i in self.special_token_ids:
            self.tokens[i] = SPECIAL_PREFIX + self.special_names.get(i, f"<[{i}]>").encode()
        self.eos_token_id, self.bos_token_id = eos_id, getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer
        self._ids = {data: _preferred(tokenizer, ids) for data, ids in vocab.items()}
        self._longest = max(map(len, vocab), default=1)
        self._cache: dict[bytes, list[int]] = {}  # a grammar's forced texts recur at every completion

    def __call__(self, data: bytes) -> list[int]:
        """Ids spelling exactly `data`: the tokenizer's own encoding where it does (a SentencePiece one adds a
        leading "▁", a word-level one may give <unk>), else the longest tokens left to right. Never raises:
        llguidance calls it from Rust, where a Python exception is a panic."""
        data = data.encode() if isinstance(data, str) else bytes(data)
        ids = self._cache.get(data)
        if ids is None:
            ids = self._spell(data)
            if len(self._cache) < CALLBACK_CACHE_SIZE:
                self._cache[data] = ids
        return list(ids)

    def _spell(self, data: bytes) -> list[int]:
        try:
            ids = list(self._tokenizer.encode(data.decode("utf-8"), add_special_tokens=False))
            if b"".join(self.tokens[i] for i in ids) == data:
                return ids
        except Exception:  # undecodable bytes, ids past the vocabulary, a tokenizer without encode
            pass
        return self._longest_match(data)

    def spells_a_start(self, data: bytes) -> bool:
        if data.startswith(SPECIAL_PREFIX):  # a special token the grammar names
            return True
        return any(data[:k] in self._ids for k in range(1, min(len(data), self._longest) + 1))

    def _longest_match(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if (i := self._ids.get(data[at:end])) is not None:
                    ids.append(i)
                    at = end
                    break
            else:  # no token starts with this byte (a vocabulary without byte fallback): stop there
                break
        return ids


def _special_names(tokenizer, ids: list[int]) -> dict[int, str]:
    """{id: name} of the ids the tokenizer names `<...>` (its special and added tokens: "<|im_end|>", "</s>")."""
    names = {}
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    for i in ids if convert is not None else ():
        try:
            name = convert(i)
        except (IndexError, KeyError, ValueError, TypeError):
            continue
        if isinstance(name, str) and name.startswith("<") and name.endswith(">") and len(name) > 2:
            names[i] = name
    return names


def _preferred(tokenizer, ids: list[int]) -> int:
    """The id to spell these bytes with: a SentencePiece vocabulary spells a letter both as itself and as a
    byte-fallback piece ("<0x48>"); the piece of its own is the one its tokenizer would use."""
    if len(ids) == 1:
        return ids[0]
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    return min(ids, key=lambda i: (convert is not None and sentencepiece_byte(str(convert(i) or "")) is not None, i))


class GrammarVocabulary:
    """llguidance's tokenizer (`llg`) over `vocab` (bytes -> ids) for a model with `vocab_size` logits, and
    `num_words`, the int32 words of its masks (at least the model's W)."""

    def __init__(self, tokenizer, vocab: dict[bytes, list[int]], vocab_size: int, eos_token_ids: list[int]):
        llg = _llguidance()
        num_ids = max([vocab_size, *(i + 1 for ids in vocab.values() for i in ids)])
        eos = list(eos_token_ids) or [num_ids]  # where the model has no EOS: an id past the logits, never sampled
        num_ids = max(num_ids, *(i + 1 for i in eos))
        self.bytes = _ByteTokenizer(tokenizer, vocab, num_ids, eos[0])
        self.special_names = frozenset(self.bytes.special_names.values())
        self.llg = llg.LLTokenizer(llg.TokenizerWrapper(self.bytes), n_vocab=num_ids, eos_token=eos)
        self.num_words = -(-num_ids // 32)
        self.logits_W = pack_token_ids(np.arange(vocab_size), -(-vocab_size // 32))  # the ids the model has

    def can_begin(self, data: bytes) -> bool:
        """Whether some token spells a beginning of `data` (text the grammar forces next). Where none does (a
        word-level vocabulary lacks most single characters), llguidance's mask skips the forced text and
        offers what follows it: nothing may be sampled there instead."""
        return self.bytes.spells_a_start(data)


def serialize(guided, special_names: frozenset = frozenset()) -> str:
    """llguidance's grammar for a GuidedDecodingParams: a `grammar` (EBNF or Lark text), a `structural_tag`
    (vLLM's JSON: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}), a
    `json` schema or `json_object`; ValueError on a bad one. `special_names`: the vocabulary's special tokens
    ("<|im_start|>"): a trigger written "<...>" is that token where it is one, else text ("<tool_call>" in a
    vocabulary that spells it)."""
    llg = _llguidance()
    if guided.kind == "grammar":  # GBNF is converted to Lark; Lark passes as it is
        if _is_lark(guided.grammar):
            return llg.grammar_from("lark", guided.grammar)
        return llg.grammar_from("grammar", _gbnf_escapes(guided.grammar))
    if guided.kind in ("json", "json_object"):
        schema = json.loads(guided.json) if guided.kind == "json" else {"type": "object"}  # any object, any depth
        return json_grammar(llg, schema, guided.whitespace)
    try:
        tag = json.loads(guided.structural_tag)
        triggers, structures = tag["triggers"], tag["structures"]
        if not isinstance(triggers, list) or not isinstance(structures, list) or not structures:
            raise TypeError("triggers and structures must be lists, structures not empty")
        tags = []
        for s in structures:
            trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger in {triggers} begins the structure's begin {s['begin']!r}")
            schema = {} if s["schema"] is True else s["schema"]
            if not isinstance(schema, dict):
                raise TypeError(f"a structure's schema must be a JSON schema object, got {schema!r}")
            tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=json.dumps(schema), end=s["end"]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"structural_tag must be JSON {{\"structures\": [{{\"begin\", \"schema\", \"end\"}}], "
                         f"\"triggers\": [...]}}: {type(e).__name__}: {e}") from e
    tagged = [t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")]
    return llg.StructTag.to_grammar(tags, assume_special=bool(tagged) and all(t in special_names for t in tagged))


def _is_lark(grammar: str) -> bool:
    """Lark unless it has GBNF's `::=` (vLLM's xgrammar rule): llguidance's own test knows only grammars that
    begin with `start:`, so Lark's `?start: value` (inline the rule) went to the GBNF converter and failed."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    return is_lark_syntax(grammar) or "::=" not in grammar


_GBNF_ESCAPE = re.compile(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")


def _gbnf_escapes(grammar: str) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX escapes as llguidance's converter reads them: it drops their leading
    zeros ("\\u00e9" becomes "\\ue9", which its Lark lexer refuses). ASCII becomes \\xXX (a quote or bracket stays
    escaped), any other code point the character itself; an escaped backslash stays as written."""
    def spell(match: re.Match) -> str:
        hex_digits = match.group(1) or match.group(2)
        if hex_digits is None:
            return match.group(0)
        code = int(hex_digits, 16)
        if code < 0x80:
            return f"\\x{code:02x}"
        return match.group(0) if 0xD800 <= code < 0xE000 or code > 0x10FFFF else chr(code)
    return _GBNF_ESCAPE.sub(spell, grammar)


def compile_matcher(llg_tokenizer, grammar: str):
    """A matcher at the grammar's start (the guide's "index": each completion walks a deep copy of it);
    ValueError with llguidance's message when the grammar does not compile (or llguidance panics on it)."""
    try:
        matcher = _llguidance().LLMatcher(llg_tokenizer, grammar, log_level=0)  # (errors are a state, not raised)
    except BaseException as e:
        if not is_panic(e):
            raise
        raise ValueError(f"llguidance failed on it: {e}") from None
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def is_panic(error: BaseException) -> bool:
    """Whether `error` is a Rust panic surfacing from llguidance (pyo3's PanicException, a BaseException): one
    request's guide fails with it, never the engine's thread or the server."""
    return type(error).__name__ == "PanicException"


class GrammarState:
    """One completion's place in its grammar: GuideState's interface (lmjax.engine.guided) over an
    llguidance matcher. `owner`: the engine's GuidedDecoding (num_words, eos_W, not_eos_W, grammar_vocabulary)."""

    def __init__(self, owner, template, allowed_W: np.ndarray | None, ignore_eos: bool):
        self._matcher = template.deep_copy()
        self._owner, self._allowed_W, self._ignore_eos = owner, allowed_W, ignore_eos
        self._vocab = owner.grammar_vocabulary()
        self._buffer = np.zeros(self._vocab.num_words, np.int32)  # llguidance writes int32 words here
        self._mask_W: np.ndarray | None = None
        self._unspellable: bytes | None = None  # forced text no token spells (GrammarVocabulary.can_begin)
        self._panic: str | None = None  # llguidance panicked (a Rust bug): this completion ends in an error
        self.complete = False
        self.error: str | None = None

    def mask_W(self) -> np.ndarray:
        if self._mask_W is None:
            try:
                self._matcher.unsafe_compute_mask_ptr(self._buffer.ctypes.data, self._buffer.nbytes)
                forced = self._matcher.compute_ff_bytes()
            except BaseException as e:  # a panic in llguidance: this completion's guide is broken, nothing else
                if not is_panic(e):
                    raise
                self._buffer[:], forced, self._panic = 0, b"", f"guided decoding failed inside llguidance: {e}"
            mask_W = self._buffer.view(np.uint32)[:self._owner.num_words] & self._vocab.logits_W
            if forced and not self._vocab.can_begin(forced):
                mask_W[:] = 0
                self._unspellable = forced
            self.complete = self._matcher.is_accepting()
            if self._matcher.is_stopped() and not self.complete:  # a dead end: llguidance offers EOS alone
                mask_W[:] = 0
            if self.complete:  # every EOS id may end it, unless ignore_eos (a grammar naming one mid-way keeps it)
                mask_W = mask_W & self._owner.not_eos_W if self._ignore_eos else mask_W | self._owner.eos_W
            self._mask_W = mask_W if self._allowed_W is None else mask_W & self._allowed_W
        return self._mask_W

    def advance(self, token: int) -> str | None:
        """GuideState.advance: "stop" when nothing but EOS may follow a complete output, "error" (with
        `self.error`) when the token was not allowed or nothing may follow, else None."""
        try:
            consumed = self._panic is None and self._matcher.consume_token(token)
        except BaseException as e:
            if not is_panic(e):
                raise
            consumed, self._panic = False, f"guided decoding failed inside llguidance: {e}"
        if not consumed:  # a token the grammar refuses, a parser limit reached, or a panic
            reason = (self._matcher.get_error().strip().splitlines() or ["refused"])[0][:300]  # (a state dump follows)
            self.error = self._panic or f"guided decoding stopped at sampled token {token}: {reason}"
            return "error"
        self._mask_W = None
        mask_W = self.mask_W()
        only_eos = not (mask_W & self._owner.not_eos_W).any()
        if self._matcher.is_stopped() or (only_eos and self.complete) or not mask_W.any():
            if self.complete:
                return "stop"
            self.error = ("guided decoding: no allowed token can continue the output (allowed_token_ids?)"
                          if self._unspellable is None else "guided decoding: no token of the vocabulary spells the "
                          f"grammar's next text {self._unspellable[:40]!r}")
            return "error"
        return None

