"""Streaming detokenizer (real byte-level BPE: SmolLM2's GGUF tokenizer) and stop-string matching."""
import os

import pytest

from lmjax.engine.detokenizer import IncrementalDetokenizer
from lmjax.engine.stop import StopStringMatcher, find_stop, partial_stop_len

TEXTS = [
    "你好，世界！🙂",
    "pipeline函数是一个更高级别的 API，设计用于让用户轻松实例化和使用 AsyncEngine。",
    "展示如何设置 tp 数的例子: backend_config = TurbomindEngineConfig(tp=2) 🚀🇨🇳 done.",
    "Plain English, with  double spaces,\nnewlines\tand tabs... and émojis 👩‍👩‍👧.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner, self.window_sizes = inner, []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def stream(detok, ids, chunk=1):
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [detok.flush()]


def reference(tokenizer, ids, skip):
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode_and_never_breaks_utf8(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()  # CJK really is split
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[1, 2, 3]), ids, chunk)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == reference(tokenizer, ids, True) == text


def test_held_back_until_character_completes(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\n你好<|im_end|>\n谢谢<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == detok.text == reference(tokenizer, ids, skip)
    assert ("<|im_end|>" in text) is not skip


def test_work_per_token_is_bounded(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS * 4), add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    stream(detok, ids)
    assert len(ids) > 200 and max(counting.window_sizes) <= 8
    assert detok.text == reference(tokenizer, ids, True)


def test_flush_drops_an_unfinished_last_character(tokenizer):
    """Generation stopped inside a character: as vLLM and LMDeploy, its bytes never become text (was a
    trailing U+FFFD)."""
    ids = tokenizer.encode("ok🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detok.step([i]) for i in ids)
    assert "\ufffd" not in emitted and reference(tokenizer, ids, True).endswith("\ufffd")
    assert emitted + detok.flush() == reference(tokenizer, ids, True).rstrip("\ufffd") == detok.text
    assert detok.text.startswith("ok")


def test_flush_drops_the_whole_last_token_when_it_ends_mid_character(tokenizer):
    """A last token holding a space and half an emoji (SmolLM2's " \\xf0\\x9f"): vLLM never emits a window
    ending in U+FFFD, so not its space either (probe 25: flush gave "Hello ")."""
    ids = tokenizer.encode("Hello 😀", add_special_tokens=False)[:-1]
    assert reference(tokenizer, ids[-1:], True) == " \ufffd"  # the case: a space, then broken bytes
    detok = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detok.step([i]) for i in ids)
    assert emitted + detok.flush() == "Hello" == detok.text


class MetaspaceLike:
    """SentencePiece-style decode: '▁' is a space, and a leading space of the sequence is dropped."""
    vocab = ["▁The", "▁capital", "▁is", "▁Paris", "."]

    def decode(self, ids, **kwargs):
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_leading_space_semantics():
    prompt, output = [0, 1, 2], [3, 4]
    plain = IncrementalDetokenizer(MetaspaceLike(), prompt)
    assert "".join(stream(plain, output)) == "Paris."  # == decode(output_ids)
    cont = IncrementalDetokenizer(MetaspaceLike(), prompt, continue_prompt=True)
    assert "".join(stream(cont, output)) == " Paris."  # reads on from the prompt


# ------------------------------------------------------------------ stop strings

def feed_all(matcher, pieces):
    out = []
    for p in pieces:
        result = matcher.feed(p)
        out.append(result.text)
        if result.stopped:
            return out, result
    out.append(matcher.flush())
    return out, None


def test_find_stop_and_partial():
    assert find_stop("abcXYdefXY", 0, ["XY", "def"]) == (3, "XY")
    assert find_stop("abcXYdefXY", 0, ["def", "XY"]) == (5, "def")  # the first listed found wins
    assert find_stop("abcXYdefXY", 5, ["XY", "def"]) == (8, "XY")  # "XY" at 3 ends before new text (5)
    assert find_stop("abcXYdefXY", 4, ["XY", "def"]) == (3, "XY")  # ...but one ending in new text counts
    assert find_stop("aab", 0, ["ab", "aab"]) == (1, "ab")
    assert find_stop("abc", 0, []) is None
    assert partial_stop_len("hello <|im", ["<|im_end|>"]) == 4
    assert partial_stop_len("hello <|im_end", ["<|im_end|>", "m_e"]) == 8
    assert partial_stop_len("hello", ["<|im_end|>"]) == 0


def test_split_stop_word_never_leaks():
    pieces = ["Hello", " wor", "ld<|", "im_", "end", "|> tail"]
    out, result = feed_all(StopStringMatcher(["<|im_end|>"]), pieces)
    assert result.stopped and result.stop_str == "<|im_end|>"
    assert out == ["Hello", " wor", "ld", "", "", ""]
    assert not any("<" in p for p in out)


def test_include_stop_str_in_output():
    matcher = StopStringMatcher(["<|im_end|>"], include_stop_str_in_output=True)
    out, result = feed_all(matcher, ["ab<|im", "_end|>cd"])
    assert "".join(out) == matcher.text == "ab<|im_end|>" and result.stopped


def test_false_alarm_is_released():
    out, result = feed_all(StopStringMatcher(["STOP"]), ["a ST", "OR", "Y S", "TO"])
    assert result is None and out == ["a ", "STOR", "Y ", "", "STO"]


def test_first_listed_of_several_stops_in_one_chunk_wins():
    """vLLM checks stop strings in their order: the first listed that is found wins, not the earliest."""
    matcher = StopStringMatcher(["\n\n", "###"])
    result = matcher.feed("answer### more\n\nx")
    assert result == ("answer### more", True, "\n\n") and matcher.text == "answer### more"
    assert matcher.feed("more") == ("", True, "\n\n")
    matcher = StopStringMatcher(["39", "t3"])  # both end in the chunk " t39": "39" is listed first
    assert matcher.feed(" t39") == (" t", True, "39")


def test_no_stops_passes_through():
    matcher = StopStringMatcher(None)
    assert matcher.feed("abc") == ("abc", False, None) and matcher.flush() == ""


def test_detokenizer_and_stop_on_chinese(tokenizer):
    """A Chinese stop word split across byte-level tokens stops the stream before it."""
    ids = tokenizer.encode("世界你好！结束吧，后面不该出现", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(["结束"])
    shown = ""
    for i in ids:
        result = matcher.feed(detok.step([i]))
        shown += result.text
        if result.stopped:
            break
    assert result.stopped and shown == "世界你好！"


def _feed_tokens(pieces, stops, min_tokens):
    """The engine's use: one feed a token, armed once more than min_tokens tokens are out (vLLM V1)."""
    m = StopStringMatcher(stops)
    out = ""
    for n, piece in enumerate(pieces, start=1):
        result = m.feed(piece, armed=n > min_tokens)
        out += result.text
        if result.stopped:
            return out, result.stop_str
    return out + m.flush(), None


def test_stop_strings_after_min_tokens_as_vllm_v1():
    pieces = [" Paris", ".", "\n", "It"]
    assert _feed_tokens(pieces, ["."], 0) == (" Paris", ".")
    assert _feed_tokens(pieces, ["."], 1) == (" Paris", ".")  # the 2nd token is past min_tokens=1
    assert _feed_tokens(pieces, ["."], 2) == (" Paris.\nIt", None)  # "." came with token 2: never searched
    # a stop that ends in a searched token counts even if it began before min_tokens (vLLM's look-back),
    # and the text it cuts was held back, never emitted
    assert _feed_tokens(pieces, ["s.\n"], 2) == (" Pari", "s.\n")
    assert _feed_tokens(pieces, ["s.\n"], 3) == (" Paris.\nIt", None)
