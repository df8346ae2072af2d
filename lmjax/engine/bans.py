"""Host-side bans of a request's next token (the sampler's banned ids): min_tokens' EOS and stop ids, and
bad_words (vLLM's), tokenized once at admission and matched against the output's tail each step."""
from __future__ import annotations

from collections.abc import Sequence

from lmjax.config import SamplingParams


def row_banned_ids(params: SamplingParams, output_ids: Sequence[int], eos_token_ids: Sequence[int],
                   bad_words_ids: Sequence[Sequence[int]] = ()) -> list[int]:
    """Ids to ban for this step: bad_token_ids; EOS and stop ids until min_tokens are out; and
    the last token of each tokenized bad word whose other tokens end the output so far."""
    banned = list(params.bad_token_ids or [])
    if len(output_ids) < params.min_tokens:
        banned += list(eos_token_ids) + list(params.stop_token_ids or [])
    for word in bad_words_ids:
        head = list(word[:-1])
        if not head or list(output_ids[len(output_ids) - len(head):]) == head:
            banned.append(word[-1])
    return sorted(set(banned))


def tokenize_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Token ids of each bad word as vLLM takes them: the word without its leading spaces, and after one space
    when that tokenizes differently into as many tokens (BPE: "Paris" and " Paris"; a SentencePiece
    tokenizer adds the word-boundary mark itself, so the spaced form is the same word or a longer one)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
