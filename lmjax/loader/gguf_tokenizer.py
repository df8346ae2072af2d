"""The tokenizer embedded in a GGUF file, without torch.

transformers reads GGUF tokenizers through a metadata reader that imports torch, which lmjax does not
need at run time, and parses the metadata again, 3x slower than `open_gguf` (benchmarks/gguf_load.py).
lmjax's one GGUF tokenizer path: `open_gguf` reads the metadata and transformers' own converter
(`convert_gguf_tokenizer`) builds the fast tokenizer, so the result is the same object transformers
would build; tests/loader/test_gguf_tokenizer.py holds the two paths to identical encodings.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from lmjax.loader.gguf import open_gguf

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


def _metadata(path: str) -> dict:
    reader = open_gguf(path)
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}


def _converter():
    """transformers' GGUF tokenizer mapping and converter: in integrations.gguf since ~5.20, integrations.ggml
    before (5.17, the GPU machine's, has an empty gguf_tokenizer_mapping module and the names in ggml)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _converter()
    metadata = _metadata(path)
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    # Older converters (transformers 5.17) also return special tokens: the file's own ids win where they exist
    config.update({k: v for k, v in extra.items() if config.get(k) is None})
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)
