"""A small SentencePiece-style tokenizer built offline with the `tokenizers` library, shaped as Llama 2's /
InternLM2's / Mistral's: a Unigram model over "▁"-prefixed pieces with byte fallback (<0x00>..<0xFF>), a
Metaspace pre-tokenizer, and a ByteFallback + Metaspace decoder that turns "▁" into a space and drops the
space at the start of a decoded sequence. With it a completion whose first token is "▁Paris" reads
" Paris" after its prompt (vLLM) but "Paris" decoded alone, and characters split into byte tokens can
straddle the prompt / output boundary: what byte-level BPE (SmolLM2) cannot show."""
from __future__ import annotations

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4 (BOS 1, EOS 2: LlamaConfig's)
WORDS = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁Hello", "▁world", "▁assistant", "▁",
         ".", ",", "!", "\n"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]


def pieces() -> list[str]:
    """The vocabulary in id order: special tokens, the 256 byte pieces, words, single letters."""
    return SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + WORDS + LETTERS


def sentencepiece_tokenizer():
    """The tokenizer as a transformers PreTrainedTokenizerFast (BOS added to encoded text, as Llama 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = pieces()
    # Scores: whole words beat spelling them out, letters beat bytes.
    scores = [0.0] * len(SPECIALS) + [-20.0] * 256 + [-1.0] * len(WORDS) + [-5.0] * len(LETTERS)
    tok = Tokenizer(models.Unigram(list(zip(vocab, scores)), unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                prepend_scheme="first")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIALS[3:])


def write_sentencepiece_tokenizer(vocab_size: int, out_dir: str) -> None:
    """write_tiny_llama's `tokenizer=` writer: saves the tokenizer (the model needs vocab_size >= its size)."""
    if vocab_size < len(pieces()):
        raise ValueError(f"the SentencePiece test tokenizer has {len(pieces())} pieces, vocab_size={vocab_size}")
    sentencepiece_tokenizer().save_pretrained(out_dir)
