"""Grammar guides (vLLM's `grammar` in EBNF or Lark, and `structural_tag`) walked by hand, without a model: on
a character vocabulary (one token per character, EOS 0) each step's mask allows exactly the characters the
grammar can take next, EOS only where the output is whole, and `advance` ends the output ("stop") where nothing
but EOS may follow; on SmolLM2's real tokenizer a structural tag leaves free text alone until its trigger and
then holds the arguments to their schema."""
import json

import numpy as np
import pytest

from char_tokenizer import CharTokenizer
from lmjax import GuidedDecodingParams, SamplingParams
from lmjax.engine.guided import GuidedDecoding

CHARS = list("0123456789-+.{}[]\":, abcdefghijklmnopqrstuvwxyz<>=/_")
EBNF = 'root ::= "ab" digit+ ("-" [a-z])?\ndigit ::= [0-9]'
LARK = 'start: "ab" DIGIT+ ("-" LETTER)?\nDIGIT: /[0-9]/\nLETTER: /[a-z]/'


@pytest.fixture(scope="module")
def guided():
    return GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])


def _ids(state) -> np.ndarray:
    return np.nonzero(np.unpackbits(state.mask_W().view(np.uint8), bitorder="little"))[0]


def _allowed(state) -> set[str]:
    return {"<eos>" if i == 0 else CHARS[i - 1] for i in _ids(state)}


def _params(ignore_eos=False, **guide):
    return SamplingParams(guided_decoding=GuidedDecodingParams(**guide), ignore_eos=ignore_eos)


@pytest.mark.parametrize("grammar", [EBNF, LARK], ids=["ebnf", "lark"])
def test_each_mask_allows_what_the_grammar_allows_next(guided, grammar):
    state = guided.new_state(_params(grammar=grammar), None)
    digits = set("0123456789")
    steps = [("a", {"a"}, None), ("b", {"b"}, None), ("4", digits, None), ("2", digits | {"-", "<eos>"}, None),
             ("-", digits | {"-", "<eos>"}, None), ("z", set("abcdefghijklmnopqrstuvwxyz"), "stop")]
    for char, allowed, result in steps:
        assert _allowed(state) == allowed, char
        assert state.advance(CHARS.index(char) + 1) == result, char
    assert state.complete


def test_ignore_eos_and_allowed_token_ids_narrow_the_grammar(guided):
    params = _params(ignore_eos=True, grammar=EBNF)
    state = guided.new_state(params, None)
    for char in "ab7":
        state.advance(CHARS.index(char) + 1)
    assert "<eos>" not in _allowed(state) and state.complete  # whole, yet it goes on: ignore_eos
    only = [CHARS.index(c) + 1 for c in "ab5"]
    state = guided.new_state(params, guided.allowed_mask(SamplingParams(allowed_token_ids=only)))
    state.advance(CHARS.index("a") + 1)
    state.advance(CHARS.index("b") + 1)
    assert _allowed(state) == {"5"}


def test_a_token_the_grammar_refuses_is_an_error_naming_it(guided):
    state = guided.new_state(_params(grammar=EBNF), None)
    assert state.advance(CHARS.index("x") + 1) == "error" and "sampled token" in state.error


def test_each_completion_walks_its_own_copy_of_the_compiled_grammar(guided):
    first, second = (guided.new_state(_params(grammar=LARK), None) for _ in range(2))
    first.advance(CHARS.index("a") + 1)
    assert _allowed(first) == {"b"} and _allowed(second) == {"a"}
    assert guided.index(GuidedDecodingParams(grammar=LARK)) is guided.index(GuidedDecodingParams(grammar=LARK))


def test_text_the_vocabulary_cannot_spell_is_refused_not_skipped(guided):
    # "Q" has no token here (as a word-level vocabulary lacks single characters); llguidance's own mask would skip
    # the text it cannot tokenize and offer what follows it ([a-z] here)
    with pytest.raises(ValueError, match="vocabulary has no token that can begin.*grammar="):
        guided.check(_params(grammar='root ::= "Qb" [a-z]'))
    state = guided.new_state(_params(grammar='root ::= "aQb" [a-z]'), None)
    assert state.advance(CHARS.index("a") + 1) == "error" and not state.mask_W().any()
    assert state.error == "guided decoding: no token of the vocabulary spells the grammar's next text b'Qb'"


def test_structural_tag_guides_the_arguments_after_the_trigger(smollm2_tokenizer):
    tok = smollm2_tokenizer
    guided = GuidedDecoding(tok, len(tok), [tok.eos_token_id])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(structural_tag=tag))
    guided.check(params)
    state = guided.new_state(params, None)
    free = tok.encode("Let me check. ", add_special_tokens=False)
    for token in free:  # free text: (nearly) any token, and EOS may end it
        assert len(_ids(state)) > 0.9 * len(tok) and state.complete
        assert state.advance(token) is None
    for token in tok.encode("<function=get_weather>", add_special_tokens=False):
        assert state.advance(token) is None
    texts = {tok.decode([int(i)]) for i in _ids(state)}
    assert texts and all(t.lstrip().startswith("{") or not t.strip() for t in texts), sorted(texts)[:20]
    assert not state.complete  # mid-call: EOS is not allowed
    for token in tok.encode('{"city": "Paris"}</function>', add_special_tokens=False):
        assert state.advance(token) is None
    assert state.complete and tok.eos_token_id in _ids(state)


def test_structural_tag_without_a_matching_trigger_is_a_value_error(smollm2_tokenizer):
    tok = smollm2_tokenizer
    tag = json.dumps({"triggers": ["<tool"], "structures": [{"begin": "<function=f>", "schema": {}, "end": ""}]})
    with pytest.raises(ValueError, match="no trigger in \\['<tool'\\] begins"):
        GuidedDecoding(tok, len(tok), [tok.eos_token_id]).check(
            SamplingParams(guided_decoding=GuidedDecodingParams(structural_tag=tag)))
