"""A guided output may go on past a point where it could already end (probe 24): outlines-core's Index (a
leftmost-first DFA whose matches show one byte late) dropped the tokens that continue a shorter match, so a
guided_choice that extends another choice, a JSON number's fraction, a bounded integer's second digit and a
regex's optional suffix could never be generated. Each guide's regex now ends with an END sentinel of its own
token id (lmjax.engine.guided); vLLM's backends allow every token that keeps the output a valid prefix."""
import tempfile

import pytest

from conftest import smollm2_gguf_path, write_tiny_llama
from lmjax import LLM, GuidedDecodingParams, SamplingParams
from lmjax.engine.guided import GuidedDecoding


@pytest.fixture(scope="module")
def smollm2():
    from lmjax.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_gguf_path())
    return tok, GuidedDecoding(tok, 49152, [tok.eos_token_id])


def _blocked_at(tok, guided_decoding, guided, text):
    """None if the tokenizer's own tokens for `text` all pass the guide's masks, else the first blocked token."""
    params = SamplingParams(guided_decoding=guided)
    guided_decoding.check(params)
    state = guided_decoding.new_state(params, None)
    for t in tok.encode(text, add_special_tokens=False):
        mask = state.mask_W()
        if not (mask[t >> 5] >> (t & 31)) & 1:
            return tok.convert_ids_to_tokens([t])[0]
        state.advance(t)
    return None


@pytest.mark.parametrize("guided, text", [
    (GuidedDecodingParams(choice=["Paris", "Paris, France"]), "Paris, France"),
    (GuidedDecodingParams(choice=["1", "10", "100"]), "10"),
    (GuidedDecodingParams(choice=["yes", "yes please"]), "yes please"),
    (GuidedDecodingParams(regex=r"\d{3}(-\d{4})?"), "555-1234"),
    (GuidedDecodingParams(json={"type": "number"}), "3.14"),
    (GuidedDecodingParams(json={"type": "integer", "minimum": 0}), "42"),
    (GuidedDecodingParams(json={"type": "integer", "minimum": 1, "maximum": 100}), "42"),
], ids=["choice-shared-prefix", "choice-digits", "choice-space", "regex-optional-suffix", "number-fraction",
        "int-minimum", "int-range"])
def test_valid_outputs_that_extend_a_complete_one_stay_reachable(smollm2, guided, text):
    tok, guided_decoding = smollm2
    assert _blocked_at(tok, guided_decoding, guided, text) is None, f"{text!r} cannot be generated"


def test_engine_choice_with_shared_prefix_reaches_the_longer_choice():
    """Tiny Llama (tokens t0..t255 spell b"t0".. b"t255"): the bias makes t8 the greedy pick wherever it is
    allowed; after t7 it is (the output "t7t8" is one of the choices), so the answer must be [7, 8]."""
    path = write_tiny_llama(tempfile.mkdtemp(), eos_token_id=3)
    llm = LLM(path, max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={8: 100.0},
                            guided_decoding=GuidedDecodingParams(choice=["t7", "t7t8"]))
    out = llm.generate([[5, 9, 12]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7, 8, 3], out.token_ids  # got [7]: "t7t8" is unreachable (then EOS, forced)
