"""Guided-decoding fixes found by probing (no model: a character vocabulary, the guides walked by hand): a regex
anchored with ^ / $ compiles (outlines' Index rejects a leading ^), a JSON schema's integer minimum / maximum
(and the exclusive forms) bound the output (outlines-core ignored them; JSON is llguidance's now), and
allowed_token_ids that leave a guide no first token are a ValueError at submission."""
import pytest

from lmjax import GuidedDecodingParams, SamplingParams
from lmjax.engine.guided import GuidedDecoding
from lmjax.engine.guided_regex import strip_anchors
from char_tokenizer import CharTokenizer

CHARS = list('0123456789-+.eE{}[]":, abcdefghijklmnopqrstuvwxyz\n')


@pytest.fixture(scope="module")
def guided():
    return GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])


def _walk(guided, params, text):
    """Feed `text` one character at a time; the last advance's result (None, "stop", "error")."""
    state = guided.new_state(params, None)
    result = None
    for c in text:
        token = CHARS.index(c) + 1
        if not (state.mask_W()[token >> 5] >> (token & 31)) & 1:
            return "masked"
        result = state.advance(token)
    return result


def test_anchored_regex_compiles_and_matches_the_whole_output(guided):
    params = SamplingParams(guided_decoding=GuidedDecodingParams(regex=r"^[0-9]{3}-[a-z]+$"))
    guided.check(params)  # was: ValueError "anchored universal start state doesn't exist"
    assert _walk(guided, params, "123-ab") is None and _walk(guided, params, "12a") == "masked"
    assert strip_anchors(r"\Aab\z") == "ab" and strip_anchors(r"a\$") == r"a\$" and strip_anchors("[^a]$") == "[^a]"
    with pytest.raises(ValueError, match=r"regex='a\|\^b' cannot be compiled.*anchors"):
        guided.check(SamplingParams(guided_decoding=GuidedDecodingParams(regex="a|^b")))


def _whole(guided, params, text) -> bool:
    """Whether the guide lets `text` be written in full and then end (EOS, id 0, allowed or nothing else left)."""
    state = guided.new_state(params, None)
    for c in text:
        token = CHARS.index(c) + 1
        if not (state.mask_W()[token >> 5] >> (token & 31)) & 1 or state.advance(token) == "error":
            return False
    return state.complete and bool(state.mask_W()[0] & 1 or not state.mask_W().any())


def test_integer_bounds_constrain_the_json(guided):
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "t": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
        "xs": {"type": "array", "items": {"$ref": "#/$defs/pct"}}},
        "required": ["n", "t", "xs"], "$defs": {"pct": {"type": "integer", "minimum": 0, "maximum": 100}}}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))
    assert _whole(guided, params, '{"n": 5, "t": -9, "xs": [0, 100]}')
    for bad in ('{"n": 10, "t": 0, "xs": []}', '{"n": 0, "t": 0, "xs": []}', '{"n": 1, "t": 10, "xs": []}',
                '{"n": 1, "t": -10, "xs": []}', '{"n": 1, "t": 0, "xs": [101]}'):
        assert not _whole(guided, params, bad), bad
    assert _whole(guided, params, '{"n": 1, "t": -0, "xs": []}')  # -0 is JSON's 0: valid (outlines' regex refused it)


@pytest.mark.parametrize("lo, hi", [(1, 9), (-5, 5), (-120, -3), (None, 7), (None, -7), (3, None), (-3, None),
                                    (17, 2345), (0, 0), (99, 101), (None, 0)])
def test_integer_ranges(guided, lo, hi):
    bounds = {"minimum": lo, "maximum": hi}
    schema = {"type": "integer", **{k: v for k, v in bounds.items() if v is not None}}
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))
    for v in [*range(-150, 150), -3000, -2346, -2345, -121, 2344, 2345, 2346, 3000]:
        assert _whole(guided, params, str(v)) == ((lo is None or v >= lo) and (hi is None or v <= hi)), v
    assert not any(_whole(guided, params, s) for s in ("00", "01", "-01", "", "-", "1.0", "1e2"))


def test_allowed_token_ids_that_exclude_the_guide_fail_at_submission(guided):
    choice = GuidedDecodingParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match=r"allowed_token_ids \[1, 2\] leave no token.*choice"):
        guided.check(SamplingParams(guided_decoding=choice, allowed_token_ids=[1, 2]))
    guided.check(SamplingParams(guided_decoding=choice, allowed_token_ids=[CHARS.index("y") + 1]))  # one way in
    with pytest.raises(ValueError, match=r"minimum \(5\) is greater than maximum \(1\)"):
        guided.check(SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "integer", "minimum": 5,
                                                                               "maximum": 1})))


def test_grammars_that_cannot_compile_or_begin_are_value_errors_naming_them(guided):
    # the server maps ValueError to a 400 (a bare NotImplementedError was a 500); CHARS' vocabulary has a token
    # for every character the grammars below use, so each fails for the reason its message names
    bad = {"root ::= foo": "grammar='root ::= foo' cannot be compiled.*Rule 'foo' not found",
           "start: foo": "unknown name",
           '{"structures": []}': "structural_tag=.*cannot be compiled.*'triggers'"}
    for spec, message in bad.items():
        kind = "structural_tag" if spec.startswith("{") else "grammar"
        with pytest.raises(ValueError, match=message):
            guided.check(SamplingParams(guided_decoding=GuidedDecodingParams(**{kind: spec})))


def test_json_object_honours_the_whitespace_options(guided):
    # json_object ignored disable_any_whitespace / whitespace_pattern (a JSON schema took them)
    def walks(text, **options):
        return _walk(guided, SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True, **options)),
                     text) in (None, "stop")
    assert walks('{"a":[1,2],"b":{"c":null}}', disable_any_whitespace=True)
    assert not walks('{ "a": 1}', disable_any_whitespace=True)
    assert walks('{\n  "a": 1,\n  "b": "x"\n}', whitespace_pattern=r"[\n ]*")
    assert walks('{ "a": 1}') and not walks('{\n"a": 1}')


def test_json_object_nests_to_any_depth(guided):
    # its regex stopped at two levels (outlines' own three-level one took 6 s to compile); llguidance has no limit
    deep = '{"a": {"b": [{"c": [[1, {"d": "x"}]]}]}}'  # (not "e": CHARS spells it twice, the vocabulary keeps one)
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True))
    assert _walk(guided, params, deep) == "stop"
    assert _walk(guided, params, "[1, 2]") == "masked" and _walk(guided, params, '{"a": 1,}') == "masked"