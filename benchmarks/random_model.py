"""Random-weight Llama checkpoints of named shapes, for benchmarks.

    python benchmarks/random_model.py llama-3.2-1b /tmp/l1b --dtype bfloat16          # transformers' init
    python benchmarks/random_model.py llama-3-8b /tmp/l8b --dtype bfloat16 --fast     # seconds on a GPU

Only the shapes matter for speed. Two writers:
- `write_random_checkpoint`: transformers builds the model (its own random init) and `save_pretrained`s
  it. Slow for big shapes: the init runs on the CPU (~67 s for the 1B shape on the GPU machine's host).
- `write_fast_checkpoint`: the parameter names and shapes come from a transformers model built on the
  "meta" device (no memory, no init), each tensor is drawn by torch on the GPU when there is one
  (normal * 0.02, norms = 1, as transformers' init), moved to the host and written with safetensors in
  shards of a few GB plus the index, the way `save_pretrained` lays them out. Same file format, same
  names; only the random values differ. `ensure_checkpoint` writes one once under /tmp and reuses it.
The tokenizer is a synthetic word-level one with exactly `vocab_size` entries ("t0", "t1", ...): every id
the model can sample decodes to something, and no real tokenizer has to be available offline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

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


def _llama_config(shape: str, dtype: str):
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown; choose one of {sorted(SHAPES)}")
    return LlamaConfig(**SHAPES[shape], bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype=dtype,
                       architectures=["LlamaForCausalLM"])  # save_pretrained of a model would add it


def parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor `save_pretrained` would write: a model on the meta device costs
    nothing, and named_parameters() drops the tied lm_head as save_pretrained does."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _random_tensor(name: str, shape, dtype, device, generator):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(0.02)
    return x.to(dtype).cpu()


def write_fast_checkpoint(shape: str, out_dir: str, dtype: str = "bfloat16", seed: int = 0,
                          device: str | None = None, shard_bytes: int = 4 << 30) -> str:
    """Write config, random safetensors shards (+ index) and a tokenizer for `shape`; returns out_dir."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config = _llama_config(shape, dtype)
    torch_dtype = getattr(torch, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], [], 0
    for name, shp in parameter_shapes(config):  # group into shards of at most shard_bytes
        nbytes = torch_dtype.itemsize * math.prod(shp)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shp))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {name: _random_tensor(name, shp, torch_dtype, device, generator) for name, shp in group}
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    write_tokenizer(config.vocab_size, out_dir)
    if device == "cuda":
        torch.cuda.empty_cache()  # hand the memory back before an engine wants it
    return out_dir


DONE_MARKER = ".lmjax-complete"


def ensure_checkpoint(shape: str, dtype: str = "bfloat16", root: str | None = None, seed: int = 0) -> tuple[str, float]:
    """A fast random checkpoint of `shape` under `root` (default: the temp dir), written once and reused
    (a marker file says it was written completely); returns (path, seconds spent writing it)."""
    path = os.path.join(root or tempfile.gettempdir(), f"lmjax-ckpt-{shape}-{dtype}-s{seed}")
    if os.path.exists(os.path.join(path, DONE_MARKER)):
        return path, 0.0
    start = time.perf_counter()
    write_fast_checkpoint(shape, path, dtype, seed)
    open(os.path.join(path, DONE_MARKER), "w").close()
    return path, time.perf_counter() - start


def checkpoint_bytes(model_dir: str, itemsize: int | None = None, only: str | None = None) -> int:
    """Parameter bytes of a safetensors checkpoint, from the file headers only (no tensor is read);
    with `itemsize`, the bytes of the same parameters in that dtype (e.g. float32 files served as bf16);
    with `only`, of that one tensor (0 when absent)."""
    import struct

    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for file in sorted(os.listdir(model_dir)):
        if not file.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, file), "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name == "__metadata__" or (only is not None and name != only):
                continue
            total += math.prod(info["shape"]) * (itemsize or sizes.get(info["dtype"], 2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast", action="store_true", help="write_fast_checkpoint (torch on the GPU if any)")
    args = parser.parse_args()
    start = time.perf_counter()
    write = write_fast_checkpoint if args.fast else write_random_checkpoint
    path = write(args.shape, args.out_dir, args.dtype, args.seed)
    print(json.dumps({"shape": args.shape, "path": path, "dtype": args.dtype, "fast": args.fast,
                      "seconds": round(time.perf_counter() - start, 1), "bytes": checkpoint_bytes(path)}))


if __name__ == "__main__":
    main()
