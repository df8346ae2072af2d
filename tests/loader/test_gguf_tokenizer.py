"""The torch-free GGUF tokenizer equals transformers' own GGUF tokenizer: same ids, text, special tokens
and chat template (lmjax never needs torch at run time)."""
import os

from transformers import AutoTokenizer

from lmjax.loader.gguf_tokenizer import gguf_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "你好，世界！🙂", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x ** 2"]


def test_torch_free_tokenizer_matches_transformers(smollm2_gguf):
    ours = gguf_tokenizer(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == (theirs.bos_token, theirs.eos_token,
                                                                   theirs.eos_token_id)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_token_bytes_rejoin_characters_split_over_tokens(smollm2_tokenizer):
    """OpenAI's logprob `bytes`: a token holding part of a UTF-8 character gives its own bytes (decode
    alone gives U+FFFD), so the tokens' bytes joined are the text; special tokens are their text."""
    from lmjax.loader.tokenizer import token_bytes

    for text in TEXTS:
        ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(token_bytes(smollm2_tokenizer, t) for t in ids).decode() == text
    split = smollm2_tokenizer("🙂", add_special_tokens=False)["input_ids"]
    assert len(split) > 1 and "\ufffd" in smollm2_tokenizer.decode(split[:1])  # a character over two tokens
