"""Random-weight Llama checkpoints of named shapes, written with transformers, for benchmarks.

    python benchmarks/random_model.py llama-3.2-1b /tmp/l1b --dtype bfloat16

Only the shapes matter for throughput, so the weights are transformers' own random init and the
tokenizer is a synthetic word-level one with exactly `vocab_size` entries ("t0", "t1", ...): every id
the model can sample decodes to something, and no real tokenizer has to be available offline.
"""
from __future__ import annotations

import argparse
import json
import os

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# LlamaConfig keyword arguments of each public model's shape.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0),
}
EOS_ID, BOS_ID = 0, 1


def write_tokenizer(vocab_size: int, out_dir: str) -> None:
    """A word-level tokenizer over "t0".."t{V-1}" (t0 is EOS, t1 BOS), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", bos_token="t1", unk_token="t2")
    fast.save_pretrained(out_dir)


def write_random_checkpoint(shape: str, out_dir: str, dtype: str = "float32", seed: int = 0) -> str:
    """Write config.json, safetensors weights and a tokenizer for `shape` into `out_dir`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown; choose one of {sorted(SHAPES)}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    config = LlamaConfig(**SHAPES[shape], bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype=dtype)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # initialise in the target dtype: an fp32 8B would need 32 GB
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    write_tokenizer(config.vocab_size, out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_random_checkpoint(args.shape, args.out_dir, args.dtype, args.seed)
    print(json.dumps({"shape": args.shape, "path": path, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
