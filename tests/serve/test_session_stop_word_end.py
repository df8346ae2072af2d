"""Review of session 24: a session reply that a special stop word other than the end of reply ended (InternLM2's
<|action_end|>, one of its template's stop_words) lost the template's owed end-of-reply marker (<|im_end|>) in
the next turn's text; only the token the reply ended with may come off it.

InternLM2's tool-call format is `...<|action_end|>\n<|im_end|>` (the marker is still owed after <|action_end|>).

Self-contained: a real HF tokenizer (word-level, with the two special tokens added), the engine's session
table faked (no model needed)."""
import os
import sys
import types

from conftest import REPO


def _tokenizer(tmp_path):
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from random_model import write_tokenizer

    write_tokenizer(64, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|action_end|>"]})
    return tok


# LMDeploy's internlm2 template (lmdeploy/model.py InternLM2Chat7B), role-marker form
INTERNLM2 = dict(system="<|im_start|>system\n", eosys="<|im_end|>\n", user="<|im_start|>user\n",
                 eoh="<|im_end|>\n", assistant="<|im_start|>assistant\n", eoa="<|im_end|>", separator="\n",
                 stop_words=["<|im_end|>", "<|action_end|>"])


def _engine_with_session(tok, last_token: int, stop_ids):
    from lmjax import ChatTemplateConfig
    from lmjax.api.async_engine import AsyncEngine

    ae = AsyncEngine.__new__(AsyncEngine)
    seq = types.SimpleNamespace(output_token_ids=[5, 6, last_token], params=types.SimpleNamespace(stop_token_ids=stop_ids))
    ae.engine = types.SimpleNamespace(sessions={7: seq}, eos_token_ids=[tok.eos_token_id])
    ae.tokenizer = tok
    ae.chat_template = ChatTemplateConfig(model_name="internlm2", **INTERNLM2)
    return ae


def test_reply_ended_by_action_end_is_followed_by_the_owed_im_end(tmp_path):
    from lmjax.api.lmdeploy_params import lmdeploy_sampling_params

    tok = _tokenizer(tmp_path)
    action_end = tok.convert_tokens_to_ids("<|action_end|>")
    ae = _engine_with_session(tok, action_end, [])
    # the stop ids a real turn gets from the template's stop words
    params = lmdeploy_sampling_params(None, {}, ae.chat_template, tok, [tok.eos_token_id])
    assert action_end in params.stop_token_ids
    ae.engine.sessions[7].params.stop_token_ids = params.stop_token_ids

    text, _ = ae.encode([{"role": "user", "content": "result"}],
                        sequence_start=False, session_id=7)
    # the model stopped at <|action_end|>: InternLM2's reply still owes <|im_end|> before the next turn
    assert text.startswith("<|im_end|>"), text


def test_reply_ended_by_im_end_is_not_followed_by_it_again(tmp_path):
    """The case the change was made for (still right): <|im_end|> generated, not repeated."""
    from lmjax.api.lmdeploy_params import lmdeploy_sampling_params

    tok = _tokenizer(tmp_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ae = _engine_with_session(tok, im_end, [])
    params = lmdeploy_sampling_params(None, {}, ae.chat_template, tok, [tok.eos_token_id])
    ae.engine.sessions[7].params.stop_token_ids = params.stop_token_ids
    text, _ = ae.encode([{"role": "user", "content": "again"}], sequence_start=False, session_id=7)
    assert not text.startswith("<|im_end|>"), text
