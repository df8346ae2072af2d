"""GGUF file -> (HF config dict, HF-named numpy weights), so GGUF flows through the safetensors path.

Data flow:
  GGUFReader memory-maps the file (`open_gguf`: as a plain ndarray, see there)
  -> metadata `{arch}.*` / `tokenizer.ggml.*` keys become a config.json-style dict (`gguf_config`)
  -> each tensor is dequantized by `gguf.quants.dequantize` (we never decode quant blocks ourselves),
     reshaped from GGUF's reversed dims to torch order ([out, in] for linears), cast to `dtype`,
     renamed from llama.cpp names (`blk.N.attn_q.weight`) to HF names
     (`model.layers.N.self_attn.q_proj.weight`),
  -> for llama-style archs the Q/K rows are un-permuted: llama.cpp's converter reorders them so that
     rope rotates interleaved pairs (x0,x1),(x2,x3)...; HF rotates halves (x0,x_{d/2}),...
"""
from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class GGUFError(ValueError):
    """A GGUF file that cannot be turned into an HF checkpoint (names the file and the culprit)."""


# GGUF `general.architecture` -> (HF architectures entry, HF model_type, Q/K rows permuted by llama.cpp).
# qwen2 uses HF's half-rotation rope in llama.cpp too (NEOX style), so its rows are stored unpermuted.
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head RMSNorm of q and k
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensors llama.cpp adds that are not HF parameters. rope_freqs holds llama3-style per-frequency rope
# factors that HF expresses as config (rope_type "llama3"): read into the config ("rope_freq_factors",
# RopeSpec.freq_factors), not a weight.
_SKIPPED = {"rope_freqs.weight"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.cache
def _plain_array_reader():
    import gguf  # imported lazily: only GGUF users pay for it

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader over a plain-ndarray view of its memory map.

        Why: the reader slices its np.memmap once per metadata value (~250k slices for a 49k-token
        vocabulary) and dequantize slices each tensor again; every np.memmap slice runs
        memmap.__array_finalize__. A plain ndarray view reads the same mapped bytes with none of that
        (SmolLM2 on a CPU host: metadata 6.7 -> 2.5 s, dequantization 2.5 -> 1.8 s; BENCHMARKS.md,
        benchmarks/gguf_load.py). The reader itself is unchanged: it only ever assigns `self.data` once.
        """

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped):
            self._plain_data = mapped.view(np.ndarray)

    return PlainArrayReader


def open_gguf(path: str):
    """A `gguf.GGUFReader` of `path` (metadata parsed, tensors mapped, nothing dequantized); errors name
    the file. Shared per process while the file is unchanged: the tokenizer, the config and the weights
    each need the metadata, and parsing it is the slow part (seconds for a large vocabulary). Callers
    only read it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = os.stat(path)
    return _read_gguf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, mtime_ns: int, size: int):
    reader_class = _plain_array_reader()
    try:
        return reader_class(path)
    except Exception as e:  # bad magic, truncated header or data: the reader's own errors are cryptic
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader, path: str, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return value


def _architecture(reader, path: str) -> str:
    arch = _require(reader, path, "general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"{path}: unsupported general.architecture={arch!r}; supported: {sorted(_ARCHS)}")
    return arch


def _rope_scaling(reader, arch: str) -> dict | None:
    """HF legacy `rope_scaling` from `{arch}.rope.scaling.*` (or the older `rope.scale_linear`)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind == "none" and (linear := _field(reader, f"{arch}.rope.scale_linear")) not in (None, 1.0):
        kind, factor = "linear", linear
    if kind == "none" or factor is None:
        return None
    scaling = {"rope_type": kind, "type": kind, "factor": float(factor)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _config_from_reader(reader, path: str) -> dict:
    _refuse_split(reader, path)  # (a later shard has no metadata but this)
    arch = _architecture(reader, path)
    hf_arch, model_type, _ = _ARCHS[arch]

    def req(key: str) -> Any:
        return _require(reader, path, f"{arch}.{key}")

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rotated = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if int(rotated) != head_dim:  # (llama.cpp refuses it for llama; lmjax rotates whole heads only)
        raise GGUFError(f"{path}: {arch}.rope.dimension_count={rotated} differs from the head dimension {head_dim} "
                        "(attention.key_length, else embedding_length / head_count): lmjax reads GGUF files whose "
                        "rotary embeddings cover whole heads")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:  # older files: the token list is the vocab
        vocab = len(_require(reader, path, "tokenizer.ggml.tokens"))
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(reader, arch)
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": scaling,
        # transformers 5 spelling of the two keys above
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
        "max_position_embeddings": int(req("context_length")),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        # lmjax's own keys (lmjax.models.config): llama.cpp takes each bias as optional, and "llamafied" Qwen
        # models carry q/k/v biases without an output one
        "lmjax_qkv_bias": "blk.0.attn_q.bias" in names,
        "lmjax_o_bias": "blk.0.attn_output.bias" in names,
    }
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{hf_key}_token_id"] = int(token_id)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # (Llama 3.1+: llama.cpp divides each rope frequency by its factor)
        config["rope_freq_factors"] = [float(f) for f in _dequantize(freqs, path, np.float32).reshape(-1)]
    return config


def _refuse_split(reader, path: str) -> None:
    """A shard of a split GGUF (llama.cpp's gguf-split) holds some of the tensors only."""
    count = int(_field(reader, "split.count", 1))
    if count > 1:
        shard = int(_field(reader, "split.no", 0)) + 1
        raise GGUFError(f"{path}: shard {shard} of a GGUF split in {count} files; lmjax reads one file: merge "
                        "the shards first (llama.cpp's `llama-gguf-split --merge FIRST_SHARD OUT.gguf`)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name; None for tensors that have no HF counterpart."""
    if gguf_name in _SKIPPED:
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise KeyError(gguf_name)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row order: within each head, GGUF row 2i+j holds HF row j*(d/2)+i.

    The converter did reshape(H, 2, d/2, ...).swapaxes(1, 2); we reshape(H, d/2, 2, ...) and swap back.
    Works for weights [H*d, in] and biases [H*d].
    """
    rows, rest = w.shape[0], w.shape[1:]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows=} is not a multiple of 2 * {n_heads=}")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, path: str, dtype) -> np.ndarray:
    """One GGUF tensor -> numpy array in torch dim order, cast to `dtype`."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"{path}: tensor {tensor.name!r} has unsupported quant type "
                        f"{tensor.tensor_type.name} ({e})") from e
    # GGUF lists dims innermost first; numpy/torch list them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # np.array copies into a plain ndarray: never hand out views (or np.memmap subclasses) of the file.
    return np.array(values.reshape(shape), dtype=dtype)


def gguf_config(path: str) -> dict:
    """The HF config dict of a GGUF file, without dequantizing any weight (reads the header only)."""
    return _config_from_reader(open_gguf(path), path)


def load_gguf(path: str, dtype=np.float32) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a GGUF file into (HF config dict, {HF parameter name: dequantized array of `dtype`}).

    Linear weights come out [out, in] like torch. With tied embeddings (no `output.weight`) the config
    says `tie_word_embeddings: True` and there is no `lm_head.weight`.
    """
    reader = open_gguf(path)
    config = _config_from_reader(reader, path)
    permuted = _ARCHS[_field(reader, "general.architecture")][2]
    # K has its own (kv) head count under GQA; llama.cpp permuted it per kv head.
    heads_for = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for tensor in reader.tensors:
        try:
            name = hf_tensor_name(tensor.name)
        except KeyError:
            raise GGUFError(f"{path}: tensor {tensor.name!r} has no known HF name") from None
        if name is None:
            continue
        array = _dequantize(tensor, path, dtype)
        module = tensor.name.split(".")[-2]  # "attn_q" in "blk.3.attn_q.weight"
        if permuted and module in heads_for:
            try:
                array = unpermute_qk(array, heads_for[module])
            except ValueError as e:
                raise GGUFError(f"{path}: tensor {tensor.name!r} does not fit the head count: {e}") from None
        weights[name] = array
    return config, weights
