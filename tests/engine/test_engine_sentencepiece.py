"""A completion's text reads on from its prompt with a SentencePiece tokenizer (tests/sentencepiece_tokenizer.py,
shaped as Llama 2's / InternLM2's / Mistral's) on a tiny random Llama: the first output token "▁Paris" gives
" Paris", as vLLM returns (it was "Paris": the output decoded alone), and stop strings, include_stop_str_in_output,
guided regexes, a BOS-only prompt, a character split across the prompt / output boundary and a session's later
turn all see that text. A logit bias of +100 forces the tokens (the weights are random)."""
import re

import pytest

from conftest import continuation_text, write_tiny_llama
from lmjax import LLM, GuidedDecodingParams, SamplingParams
from lmjax.api.batch import run_to_completion
from sentencepiece_tokenizer import pieces, write_sentencepiece_tokenizer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("sp"), tokenizer=write_sentencepiece_tokenizer,
                            vocab_size=len(pieces()))
    return LLM(path, max_model_len=128, block_size=16)


def _id(llm, piece):
    return llm.get_tokenizer().convert_tokens_to_ids(piece)


def _forced(llm, piece="▁Paris", max_tokens=3, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias={_id(llm, piece): 100.0}, **kwargs)


def test_text_keeps_the_first_words_leading_space(llm):
    tok = llm.get_tokenizer()
    out = llm.generate([PROMPT], _forced(llm), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert ids == [_id(llm, "▁Paris")] * 3
    assert tok.decode(ids) == "Paris Paris Paris"  # the old text: the output decoded alone
    assert out.outputs[0].text == " Paris Paris Paris" == continuation_text(tok, out.prompt_token_ids, ids)


def test_streamed_pieces_start_with_the_space(llm):
    engine = llm.llm_engine
    req = engine.add_request(llm.get_tokenizer().encode(PROMPT), _forced(llm))
    pieces = []
    while not req.finished:
        engine.step()
        pieces.append(req.completions[0].take_delta()[0])
    assert "".join(pieces) == " Paris Paris Paris" and next(p for p in pieces if p) == " Paris"


def test_stop_strings_see_the_leading_space(llm):
    """A stop string is searched in the output's text only (vLLM): " Paris" stops at the first token, and
    "e is P", which needs the prompt's text, never matches."""
    params = [_forced(llm, stop=[" Paris"]), _forced(llm, stop=[" Paris"], include_stop_str_in_output=True),
              _forced(llm, stop=["e is P"]), _forced(llm, stop=["s P"])]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
    assert [(o.text, o.finish_reason, o.stop_reason) for o in outs] == [
        ("", "stop", " Paris"), (" Paris", "stop", " Paris"), (" Paris Paris Paris", "length", None),
        (" Pari", "stop", "s P")]


def test_guided_regex_counting_the_space_fullmatches(llm):
    """The guide spells "▁Paris" as b" Paris" (lmjax.engine.guided): the text now says so too."""
    params = _forced(llm, max_tokens=10, guided_decoding=GuidedDecodingParams(regex=r" Paris\."))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == _id(llm, "▁Paris") and out.finish_reason == "stop"
    assert re.fullmatch(r" Paris\.", out.text)


@pytest.mark.parametrize("skip", [True, False])
def test_bos_only_prompt(llm, skip):
    """A skipped BOS has no text to continue: "Paris ..." as a full decode (and vLLM) gives; kept, "<s>" is
    text and the space follows it."""
    out = llm.generate([{"prompt_token_ids": [1]}], _forced(llm, skip_special_tokens=skip), use_tqdm=False)[0]
    assert out.outputs[0].text == ("Paris Paris Paris" if skip else " Paris Paris Paris")
    assert out.outputs[0].text == continuation_text(llm.get_tokenizer(), [1], out.outputs[0].token_ids, skip)


def test_character_split_across_the_prompt_end(llm):
    """The prompt ends with the first two bytes of 你 (byte fallback): a completing <0xA0> gives "你"; an output
    that does not complete it starts with its own text, not U+FFFD (the old text: "" and "Paris")."""
    prompt = llm.get_tokenizer().encode("The capital is 你")[:-1]
    assert llm.get_tokenizer().convert_ids_to_tokens(prompt[-2:]) == ["<0xE4>", "<0xBD>"]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2,
                        [_forced(llm, "<0xA0>", max_tokens=1), _forced(llm, max_tokens=1)], use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["你", " Paris"]


def test_a_later_session_turn_continues_the_whole_history(llm):
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    first = engine.add_session_request("s", tok.encode(PROMPT), _forced(llm, max_tokens=2), sequence_end=False)
    run_to_completion(engine, [first])
    turn = engine.add_session_request("s", tok.convert_tokens_to_ids([".", "▁The", "▁capital", "▁is"]),
                                      _forced(llm, max_tokens=1), sequence_start=False)
    run_to_completion(engine, [turn])
    assert first.completions[0].text == " Paris Paris" and turn.completions[0].text == " Paris"
    assert tok.decode(turn.prompt_token_ids + turn.completions[0].token_ids, skip_special_tokens=True) == \
        "The capital of France is Paris Paris. The capital is Paris"
