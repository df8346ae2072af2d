"""A tiny random Llama checkpoint written with transformers, the model most tests run."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny random Llama (GQA 2) that several tests build: write_tiny_llama's base config.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)


def write_tiny_llama(path, tokenizer=None, **config_overrides) -> str:
    """Save a tiny random Llama (TINY_LLAMA, `config_overrides` replacing or adding LlamaConfig fields;
    weights from torch seed 0) and a tokenizer under `path`; returns the path as a str. `tokenizer`:
    a writer (vocab_size, out_dir), by default benchmarks/random_model.py's word-level one ("t0".."tN");
    sentencepiece_tokenizer.write_sentencepiece_tokenizer writes a SentencePiece-style one."""
    import sys

    import torch
    import transformers

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from random_model import write_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, **config_overrides})
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    (tokenizer or write_tokenizer)(cfg.vocab_size, str(path))
    return str(path)
