"""The END sentinel (b"\\x00", lmjax/engine/guided.py) is a byte that the *user's* regex may match: `.`,
`[^...]`, `\\D`, `\\W` all match NUL. `GuideState.complete` is read off "END is allowed next", which is then also
true wherever the regex could go on with a NUL, so EOS is unmasked in the middle of an output that is not a
whole match (an unterminated JSON string with format "uri" or a "pattern", a regex ".+x" after "a")."""
import tempfile

import pytest


from lmjax import GuidedDecodingParams, SamplingParams  # noqa: E402
from lmjax.engine.guided import GuidedDecoding  # noqa: E402
from char_tokenizer import CharTokenizer

CHARS = list('0123456789-+.eE{}[]":, abcdefghijklmnopqrstuvwxyz@/')


@pytest.fixture(scope="module")
def guided():
    return GuidedDecoding(CharTokenizer(CHARS), len(CHARS) + 1, [0])


def _eos_allowed_after(guided, gd, text) -> bool:
    state = guided.new_state(SamplingParams(guided_decoding=gd), None)
    for c in text:
        t = CHARS.index(c) + 1
        assert (state.mask_W()[t >> 5] >> (t & 31)) & 1, f"{c!r} masked"
        assert state.advance(t) is None
    return bool(state.mask_W()[0] & 1)  # EOS is id 0


@pytest.mark.parametrize("gd, prefix", [
    (GuidedDecodingParams(regex=r".+x"), "a"),
    (GuidedDecodingParams(regex=r'"[^"]*"'), '"ab'),
    (GuidedDecodingParams(regex=r"[^@]+@[a-z]+"), "ab"),
    (GuidedDecodingParams(json={"type": "string", "format": "uri"}), '"http://a'),
    (GuidedDecodingParams(json={"type": "string", "pattern": "^[^@]+@x$"}), '"ab'),
], ids=["dot", "negated-class", "email-like", "json-format-uri", "json-pattern"])
def test_eos_not_allowed_before_a_whole_match(guided, gd, prefix):
    assert not _eos_allowed_after(guided, gd, prefix), f"EOS may end {prefix!r}, which is not a whole match"


def test_engine_output_fullmatches_the_regex():
    """Tiny Llama (tokens t0..t255 spell b"t0".."t255", EOS 3). After "t7" the output "t7" does not match
    t7.*t8, so EOS must stay masked and the biased t8 comes next; with the bug EOS (bias 100) ends it at [7]."""
    from conftest import write_tiny_llama
    from lmjax import LLM

    path = write_tiny_llama(tempfile.mkdtemp(), eos_token_id=3)
    llm = LLM(path, max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={3: 100.0, 8: 60.0, 7: 50.0},
                            guided_decoding=GuidedDecodingParams(regex=r"t7.*t8"))
    out = llm.generate([[5, 9, 12]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == [7, 8], (out.token_ids, out.finish_reason)
