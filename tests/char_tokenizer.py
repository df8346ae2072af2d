"""A tokenizer of one token per character (ids 1..), EOS 0: what guided decoding's vocabulary needs
(lmjax.engine.guided), without a real tokenizer, for tests that walk guides character by character."""


class CharTokenizer:
    eos_token_id = 0
    all_special_ids = [0]
    added_tokens_decoder: dict = {}

    def __init__(self, chars):
        self.chars = list(chars)

    def get_vocab(self):
        return {"</s>": 0, **{c: i + 1 for i, c in enumerate(self.chars)}}
