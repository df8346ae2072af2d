"""The engine's detokenizer mode, `continue_prompt=True`: a completion's text reads on from its prompt, as
vLLM's and LMDeploy's do. The reference is the full decode: text == decode(prompt + output) minus
decode(prompt). SentencePiece (tests/sentencepiece_tokenizer.py) keeps the first word's leading space;
byte-level BPE (SmolLM2) is unchanged; special tokens at the prompt's end; a character split across the
prompt / output boundary never shows as U+FFFD."""
import pytest

from conftest import continuation_text
from lmjax.engine.detokenizer import IncrementalDetokenizer
from sentencepiece_tokenizer import sentencepiece_tokenizer


@pytest.fixture(scope="module")
def sp():
    return sentencepiece_tokenizer()


def stream(tokenizer, prompt, output, skip=True, chunk=1):
    """The streamed pieces (flush included) of `output` after `prompt`, as the engine detokenizes."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip, continue_prompt=True)
    pieces = [detok.step(output[i:i + chunk]) for i in range(0, len(output), chunk)] + [detok.flush()]
    assert "".join(pieces) == detok.text and detok.output_ids == output
    return pieces


def ids(tokenizer, *pieces):
    return tokenizer.convert_tokens_to_ids(list(pieces))


@pytest.mark.parametrize("chunk", [1, 2])
def test_sentencepiece_keeps_the_first_words_leading_space(sp, chunk):
    prompt, output = sp.encode("The capital of France is"), ids(sp, "▁Paris", ".", "▁Hello")
    assert sp.decode(output) == "Paris. Hello"  # what the engine returned before: decode(output) alone
    text = "".join(stream(sp, prompt, output, chunk=chunk))
    assert text == " Paris. Hello" == continuation_text(sp, prompt, output)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt_text", ["", "<|im_start|>assistant\n", "Hello<|im_end|>\n<|im_start|>",
                                         "<|im_end|><|im_start|><|im_end|><|im_start|><|im_end|><|im_start|>"])
def test_special_tokens_at_the_prompt_end(sp, prompt_text, skip):
    """Skipped special tokens have no text to continue: a BOS-only prompt (encode("") is [BOS]) gives
    "Hello world" (the space at the start of a sequence is dropped, as vLLM's stream does); kept, they are text
    the output continues (" Hello world")."""
    prompt, output = sp.encode(prompt_text), ids(sp, "▁Hello", "▁world")
    text = "".join(stream(sp, prompt, output, skip))
    assert text == continuation_text(sp, prompt, output, skip)
    if not sp.decode(prompt, skip_special_tokens=True):  # nothing but special tokens
        assert text == ("Hello world" if skip else " Hello world")


@pytest.mark.parametrize("tokenizer_name", ["sp", "smollm2_tokenizer"])
def test_character_split_at_the_prompt_end(request, tokenizer_name):
    """The prompt ends inside a character (byte fallback / byte-level BPE): when the output completes it, the
    text starts with the whole character (vLLM's DecodeStream); when not, the prompt's broken bytes are
    dropped. Never a U+FFFD."""
    tok = request.getfixturevalue(tokenizer_name)
    whole = tok.encode("你好 world", add_special_tokens=False)
    cut = next(k for k in range(1, len(whole)) if tok.decode(whole[:k]).endswith("\ufffd"))
    prompt, output = whole[:cut], whole[cut:]
    for chunk in (1, 3):
        pieces = stream(tok, prompt, output, chunk=chunk)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == "你好 world"  # 你 began in the prompt: the output completes it
    other = tok.encode(" ok", add_special_tokens=False)
    assert "\ufffd" in tok.decode(prompt + other)  # a full decode shows the prompt's broken bytes
    assert "".join(stream(tok, prompt, other)) == " ok"


def test_tail_starts_on_a_character(sp):
    """Byte fallback decodes a run of byte tokens that starts mid-character as U+FFFD throughout: the context
    reaches back to the character's start, also when the prompt ends inside another one. No character
    starts within MAX_PROMPT_CONTEXT_TOKENS: the output is decoded alone, less leading U+FFFD."""
    prompt = sp.encode("The 你好")  # ... "▁", <0xE4>, <0xBD>, <0xA0>, <0xE5>, <0xA5>, <0xBD>
    assert sp.decode(prompt[-5:]) == "\ufffd" * 5
    output = sp.encode("来 world", add_special_tokens=False)[1:]  # the bytes of 来, "▁world"
    assert "".join(stream(sp, prompt, output)) == "来 world" == continuation_text(sp, prompt, output)
    unfinished = sp.encode("你好" * 9 + "来")[:-2]  # bytes to the end, the last character unfinished
    pieces = stream(sp, unfinished, output[1:])  # the output completes 来
    assert "".join(pieces) == "来 world" and not any("\ufffd" in p for p in pieces)
    garbage = sp.encode("ok") + ids(sp, *["<0xBD>"] * 30)  # no character starts in the last 24 tokens
    assert "".join(stream(sp, garbage, ids(sp, "<0xBD>", "▁world"))) == " world"  # decoded alone, less U+FFFD


def test_flush_drops_an_unfinished_last_character_after_a_prompt(sp):
    prompt = sp.encode("The capital is")
    output = ids(sp, "▁Paris", "<0xE4>", "<0xBD>")
    pieces = stream(sp, prompt, output)
    assert pieces == [" Paris", "", "", ""] and continuation_text(sp, prompt, output).endswith("\ufffd")


def test_a_literal_replacement_character_ending_the_prompt(sp):
    prompt, output = sp.encode("ok \ufffd"), ids(sp, "▁Paris")  # U+FFFD is text there, not broken bytes
    assert "".join(stream(sp, prompt, output)) == " Paris" == continuation_text(sp, prompt, output)


PAIRS = [("The capital of France is", " Paris. It is"), ("你好，", "世界！🙂 and more"),
         ("def f(x):", "\n    return x"),
         ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "Hello!<|im_end|>")]


@pytest.mark.parametrize("prompt_text,output_text", PAIRS)
@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_text_is_unchanged(smollm2_tokenizer, prompt_text, output_text, skip):
    """Byte-level BPE tokens carry their own spaces: the continuation is decode(output) itself."""
    tok = smollm2_tokenizer
    prompt, output = tok.encode(prompt_text), tok.encode(output_text)
    alone = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    alone.step(output)
    alone.flush()
    text = "".join(stream(tok, prompt, output, skip))
    assert text == alone.text == tok.decode(output, skip_special_tokens=skip)
    assert text == continuation_text(tok, prompt, output, skip)


@pytest.mark.parametrize("tokenizer_name", ["sp", "smollm2_tokenizer"])
def test_an_outputs_literal_replacement_character_after_a_broken_prompt_end(request, tokenizer_name):
    """The prompt's unfinished bytes are dropped, not the output's own U+FFFD that follows them (every leading
    U+FFFD was stripped)."""
    tok = request.getfixturevalue(tokenizer_name)
    whole = tok.encode("你好", add_special_tokens=False)
    cut = next(k for k in range(1, len(whole)) if tok.decode(whole[:k]).endswith("\ufffd"))
    prompt, output = whole[:cut], tok.encode("\ufffd ok", add_special_tokens=False)
    broken = tok.decode(prompt)  # the prompt's unfinished bytes: U+FFFD at its end
    full = tok.decode(prompt + output)
    assert full.startswith(broken) and full.count("\ufffd") == broken.count("\ufffd") + 1
    assert "".join(stream(tok, prompt, output)) == full[len(broken):]  # " \ufffd ok" (SentencePiece), "\ufffd ok"
