"""Guided decoding (structured outputs) on the host: JSON schemas, json_object, grammars and structural tags
with llguidance (lmjax.engine.guided_grammar, vLLM's "guidance" backend), regexes and choices with outlines-core.

Data flow: a request's GuidedDecodingParams (lmjax.guided_params) is compiled when the request is submitted (so
a bad schema is a ValueError naming it, and no other request ever sees it) and kept in an LRU per (kind, spec):
a regex or choice as an outlines-core `Index` over the tokenizer's vocabulary (token id -> the bytes it stands
for), a token-level automaton; anything else as an llguidance matcher over the same bytes. Each completion
walks it with its own state (`GuideState` or guided_grammar.GrammarState: the same interface). Before a step,
the engine puts the packed mask of the tokens the state allows into the completion's SamplingRow (outlines
writes it straight into numpy: 2-5 us for a 49k vocabulary; llguidance ~10-15 us for JSON, more for some
grammars: lmjax.engine.guided_grammar); the sampler sets every other logit to -inf, greedy rows included
(lmjax.layers.sampler.apply_allowed). After the step, the state advances by the sampled token; where the
output is a whole match, EOS may end it (and the model may go on where the guide lets it); when only EOS
could follow, the next step's mask is the EOS alone and the sampled EOS ends it (`advance_guide`).
With byte-level BPE and SentencePiece vocabularies the text is the bytes the guide walked: it continues
the prompt (lmjax.engine.detokenizer), so a first "▁Paris" (b" Paris" here) is " Paris" there too, and a
regex that counts that space fullmatches the text.

Guided rows need the host between steps, so they decode one step at a time (LLMEngine._decode_steps);
`allowed_token_ids` alone is a fixed mask and rides along in multi-step calls.

Shape letters: W 32-bit words of a packed token mask, ceil(V / 32) for the model's V logits.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from lmjax.config import SamplingParams
from lmjax.engine import guided_grammar
from lmjax.engine.guided_regex import guide_regex
from lmjax.guided_params import GuidedDecodingParams
from lmjax.layers.sampler import pack_token_ids
from lmjax.loader.tokenizer import byte_level_decoder, sentencepiece_byte

logger = logging.getLogger("lmjax.engine")
INDEX_CACHE_SIZE = 32  # compiled guides kept per engine (a JSON schema's: milliseconds to a second each)
# Every guide's regex ends with END, a byte no guided output holds, under a token id of its own: the output is
# complete exactly where END may follow. outlines-core's automaton (a leftmost-first DFA whose matches show one
# byte late) drops the tokens that go on past a shorter match, so without it choice=["Paris", "Paris, France"]
# could only give "Paris", and a number "3.14" or an integer 42 not at all.
END = b"\x00"
LLGUIDANCE_KINDS = ("json", "json_object", "grammar", "structural_tag")  # lmjax.engine.guided_grammar's


def _outlines():
    try:
        import outlines_core
    except ImportError as e:  # a core dependency, but an old install may lack it: say what to do
        raise ValueError("guided decoding needs the outlines-core package: pip install 'outlines-core>=0.2.10'") from e
    return outlines_core


# ------------------------------------------------------------------ the tokenizer's vocabulary as bytes

def _byte_level_bytes(token: str) -> bytes:
    alphabet = byte_level_decoder()
    return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in token)


def _sentencepiece_bytes(token: str) -> bytes:
    """SentencePiece pieces: "▁" is a space, "<0x0A>" a byte of its own (byte fallback)."""
    byte = sentencepiece_byte(token)
    return bytes([byte]) if byte is not None else token.replace("\u2581", " ").encode()


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


def vocabulary_map(tokenizer, skip_ids: set[int]) -> dict[bytes, list[int]]:
    """{bytes: token ids} of every token a guided output may contain: all but special tokens and `skip_ids`
    (EOS, given to outlines apart). Added (non-special) tokens are plain text, the others in the
    tokenizer's own spelling (byte-level BPE or SentencePiece)."""
    to_bytes = _byte_level_bytes if _is_byte_level(tokenizer) else _sentencepiece_bytes
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = set(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}
    vocab: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special or i in skip_ids:
            continue
        data = token.encode() if i in added else to_bytes(token)
        if data:
            vocab.setdefault(data, []).append(i)
    return vocab


def _describe(guided: GuidedDecodingParams) -> str:
    value = getattr(guided, guided.kind)
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{guided.kind}={text[:200] + '...' if len(text) > 200 else text!r}"


def _shorten(text: str, keep: int = 160) -> str:
    """outlines' message less the whole regex it may quote (thousands of characters for a schema)."""
    return text if len(text) <= 2 * keep else f"{text[:keep]} ... {text[-keep:]}"


# ------------------------------------------------------------------ per engine, per completion

class GuidedDecoding:
    """One engine's guided-decoding state: the outlines Vocabulary (built on the first guided request)
    and an LRU of compiled guides. `vocab_size`: the model's logits width V."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.num_words = -(-vocab_size // 32)
        self.eos_W = pack_token_ids(self.eos_token_ids, self.num_words)
        self.not_eos_W = ~self.eos_W
        self._vocabulary, self._buffer_words, self.end_id = None, self.num_words, None
        self._grammar_vocabulary = None
        self._indexes: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # spent compiling guides (a stat)

    def vocabulary(self):
        """outlines' Vocabulary: the tokens a guided output may hold (none with a NUL byte) and the END
        sentinel, b"\x00" under an id past every real one (`self.end_id`), which each guide's regex ends with."""
        if self._vocabulary is None:
            start, oc = time.perf_counter(), _outlines()
            vocab = {b: ids for b, ids in vocabulary_map(self.tokenizer, set(self.eos_token_ids)).items()
                     if END not in b}
            eos = getattr(self.tokenizer, "eos_token_id", None)
            eos = eos if eos in self.eos_token_ids else (self.eos_token_ids or [self.vocab_size])[0]
            self.end_id = max([self.vocab_size - 1, eos, *(i for ids in vocab.values() for i in ids)]) + 1
            self._vocabulary = oc.Vocabulary(eos, {**vocab, END: [self.end_id]})
            self._buffer_words = max(self.num_words, self.end_id // 32 + 1)  # outlines' masks span ids 0..end_id
            logger.info("guided decoding vocabulary: %d tokens in %.2f s", len(vocab), time.perf_counter() - start)
        return self._vocabulary

    def grammar_vocabulary(self) -> guided_grammar.GrammarVocabulary:
        """llguidance's view of the vocabulary for grammar guides (lmjax.engine.guided_grammar): the same bytes.
        Built outside the lock (~0.25 s on a 49k vocabulary): the engine thread's lookups do not wait on it."""
        if self._grammar_vocabulary is None:
            start = time.perf_counter()
            vocab = vocabulary_map(self.tokenizer, set(self.eos_token_ids))
            built = guided_grammar.GrammarVocabulary(self.tokenizer, vocab, self.vocab_size, self.eos_token_ids)
            with self._lock:
                if self._grammar_vocabulary is None:
                    self._grammar_vocabulary = built
                    logger.info("grammar vocabulary: %d words in %.2f s", built.num_words, time.perf_counter() - start)
        return self._grammar_vocabulary

    def check(self, params: SamplingParams) -> None:
        """A ValueError naming a guide that cannot be compiled, or that no token can begin (allowed_token_ids
        or the vocabulary); the guide is compiled (and cached) here, at submission (the ids' range is checked
        before, with the request's other ids: LLMEngine.validate_request)."""
        if params.guided_decoding is not None:
            state = self.new_state(params, self.allowed_mask(params))  # compiles the guide
            if not state.mask_W().any():
                cause = (f"allowed_token_ids {list(params.allowed_token_ids)[:8]} leave" if params.allowed_token_ids
                         else "the vocabulary has")
                raise ValueError(f"{cause} no token that can begin the guided output "
                                 f"({_describe(params.guided_decoding)})")

    def index(self, guided: GuidedDecodingParams):
        """The compiled guide, from the LRU or compiled now. The server compiles off its event loop while
        the engine thread reads the cache: a lock keeps the LRU whole, taken only around the cache (a
        compile does not hold up the engine thread's lookups; two threads compiling one spec both finish)."""
        key = (guided.kind, guided.spec, guided.whitespace)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
        if guided.kind in LLGUIDANCE_KINDS:
            index = self._compile_grammar(guided)
        else:
            index = self._compile_regex(guided)
        with self._lock:
            self._indexes[key] = index
            if len(self._indexes) > INDEX_CACHE_SIZE:
                self._indexes.popitem(last=False)
        return index

    def _compile_grammar(self, guided: GuidedDecodingParams):
        vocab, start = self.grammar_vocabulary(), time.perf_counter()
        try:
            matcher = guided_grammar.compile_matcher(vocab.llg, guided_grammar.serialize(guided, vocab.special_names))
        except ValueError as e:
            raise ValueError(f"guided decoding {_describe(guided)} cannot be compiled: {_shorten(str(e))}") from e
        self._count_compile(guided, time.perf_counter() - start)
        return matcher

    def _count_compile(self, guided: GuidedDecodingParams, seconds: float) -> None:
        logger.info("compiled guide %s in %.2f s", _describe(guided), seconds)
        with self._lock:
            self.compile_seconds += seconds

    def _compile_regex(self, guided: GuidedDecodingParams):
        with self._lock:
            vocabulary = self.vocabulary()
        start = time.perf_counter()
        try:
            index = _outlines().Index(f"(?:{guide_regex(guided)})\\x00", vocabulary)  # END: see module doc
        except (ValueError, TypeError, RuntimeError) as e:  # outlines' errors for bad schemas and regexes
            anchored = "anchored" in str(e)
            hint = " (anchors such as ^ and $ are only allowed at the very start and end)" if anchored else ""
            raise ValueError(f"guided decoding {_describe(guided)} cannot be compiled: {_shorten(str(e))}{hint}") from e
        self._count_compile(guided, time.perf_counter() - start)
        return index

    def allowed_mask(self, params: SamplingParams) -> np.ndarray | None:
        """allowed_token_ids as a packed mask (fixed for the request's life), or None."""
        ids = params.allowed_token_ids
        return pack_token_ids(ids, self.num_words) if ids else None

    def new_state(self, params: SamplingParams, allowed_W: np.ndarray | None) -> GuideState | None:
        """A fresh walk of the request's guide (one per completion), or None without one."""
        guided = params.guided_decoding
        if guided is None:
            return None
        index = self.index(guided)
        state = guided_grammar.GrammarState if guided.kind in LLGUIDANCE_KINDS else GuideState
        return state(self, index, allowed_W, params.ignore_eos)


class GuideState:
    """One completion's place in its guide. `mask_W()`: the tokens it may sample next (packed uint32 [W]);
    `advance(token)` after each sampled token says whether the output ended."""

    def __init__(self, owner: GuidedDecoding, index, allowed_W: np.ndarray | None, ignore_eos: bool):
        self.guide, self._index = _outlines().Guide(index), index
        self._owner, self._allowed_W, self._ignore_eos = owner, allowed_W, ignore_eos
        self._buffer = np.zeros((1, owner._buffer_words), np.int32)  # outlines writes int32 words here
        self._address = self._buffer.ctypes.data  # (asking numpy for it each step costs a microsecond)
        self._mask_W: np.ndarray | None = None
        self.complete = False  # whether the output so far is a whole match (set with each mask)
        self.error: str | None = None

    def mask_W(self) -> np.ndarray:
        """The mask of the current state (a view of this state's buffer until the next `advance`: the batch
        copies it into its [B, W] mask before that)."""
        if self._mask_W is None:
            self.guide.write_mask_into(self._address, self._buffer.size, 4)
            words = self._buffer[0].view(np.uint32)
            end = self._owner.end_id
            self.complete = bool((words[end >> 5] >> (end & 31)) & 1) and self._whole_after_end()
            words[end >> 5] &= ~np.uint32(1 << (end & 31))  # never sampled (it may share the model's last word)
            mask_W = words[:self._owner.num_words]
            if self.complete:  # every EOS id may end it, unless ignore_eos
                mask_W &= self._owner.not_eos_W
                if not self._ignore_eos:
                    mask_W |= self._owner.eos_W
            self._mask_W = mask_W if self._allowed_W is None else mask_W & self._allowed_W
        return self._mask_W

    def _whole_after_end(self) -> bool:
        """Whether END here ends a whole match (the output may end): END is also allowed where the guide's own
        regex may go on with a NUL byte (`.`, `[^"]`), which must not let EOS in mid-output."""
        after = self._index.get_next_state(self.guide.get_state(), self._owner.end_id)
        return after is not None and self._index.is_final_state(after)

    def advance(self, token: int) -> str | None:
        """Move past `token`; then "stop" when the output is complete (nothing but EOS may follow), "error"
        (with `self.error`) when the token was not allowed or nothing may follow, else None."""
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError as e:
            self.error = f"guided decoding: sampled token {token} is not allowed here ({e})"
            return "error"
        self._mask_W = None
        mask_W = self.mask_W()  # the next step's mask, computed now (it is needed anyway) to see what may follow
        if not (mask_W & self._owner.not_eos_W).any():
            if self.complete:
                return "stop"
            self.error = "guided decoding: no allowed token can continue the output (allowed_token_ids?)"
            return "error"
        return None


def advance_guide(req, comp, token: int) -> str | None:
    """The finish reason, if any, that `token` gives a guided completion (the request's error set on one). A
    complete output whose next token may be EOS goes on for one step, its mask EOS alone: the model samples the
    EOS, which ends it as any EOS does, in token_ids and its logprobs (vLLM's structured outputs). It ends here,
    without that token, only where the EOS could not be sampled or would not stop it: ignore_eos, or min_tokens
    still banning it."""
    reason = comp.guide.advance(token)
    if reason == "error":
        req.error = comp.guide.error
    elif reason == "stop" and not req.params.ignore_eos and len(comp.token_ids) >= req.params.min_tokens:
        return None
    return reason
