"""ModelConfig: the one description of a Llama-family model that the Flax code reads.

Built from a Hugging Face `config.json` dict (old `rope_theta`/`rope_scaling` keys and transformers 5's
`rope_parameters` alike), with TurboMind's engine overrides (`rope_scaling_factor`, `use_dynamic_ntk`,
`use_logn_attn`) applied on top. Anything the model code cannot honour is rejected here, naming the
field, so a checkpoint never runs silently wrong.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pallas_kernels.rope import RopeSpec

logger = logging.getLogger("lmjax.models")

SUPPORTED_ACTIVATIONS = ("silu", "swish")
# HF rope types we implement; "default" covers configs with no scaling at all.
_ROPE_ALIASES = {"dynamic": "dynamic", "linear": "linear", "llama3": "llama3", "default": "default"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, InternLM2 `bias`, Llama `attention_bias`
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    use_logn_attn: bool = False
    logn_max_position: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        """The context the checkpoint supports, the default session_len / max_model_len (vLLM's and LMDeploy's
        derived length): max_position_embeddings, times the factor of linear or dynamic RoPE scaling (llama3's
        max_position_embeddings is already the scaled one)."""
        scaled = self.rope.rope_type in ("linear", "dynamic")
        return int(self.max_position_embeddings * (self.rope.factor if scaled else 1))

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None


class ConfigError(ValueError):
    """A config.json that lmjax cannot run faithfully."""


def _get(hf: dict, key: str, default: Any = dataclasses.MISSING, *aliases: str) -> Any:
    for name in (key, *aliases):
        if hf.get(name) is not None:
            return hf[name]
    if default is dataclasses.MISSING:
        raise ConfigError(f"config is missing required field {key!r}")
    return default


def _rope_params(hf: dict) -> dict:
    """Merge transformers 5 `rope_parameters` and legacy `rope_theta` + `rope_scaling` into one dict."""
    params = dict(hf.get("rope_parameters") or {})
    # Legacy `rope_scaling` wins where both exist: it can only be there because someone put it there.
    legacy = dict(hf.get("rope_scaling") or {})
    if "type" in legacy or "rope_type" in legacy:
        params.pop("rope_type", None)
    params.update(legacy)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def _rope_spec(hf: dict, head_dim: int, max_pos: int, overrides: dict) -> RopeSpec:
    params = _rope_params(hf)
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_ALIASES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {sorted(_ROPE_ALIASES)}")
    factor = float(params.get("factor") or 1.0)
    scale = overrides.get("rope_scaling_factor") or 0.0
    if scale > 0 or overrides.get("use_dynamic_ntk"):
        # TurboMind's engine override: dynamic NTK with the engine's factor (the config's if none given).
        rope_type, factor = "dynamic", float(scale or factor)
    # partial_rotary_factor: honoured as vLLM's Llama does (transformers' Llama / Qwen2 / Mistral rotate the whole
    # head whatever it says, so such a checkpoint's logits differ from transformers' by design: written down).
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        logger.warning("partial_rotary_factor=%s: only the first %d of %d head dims rotate, as vLLM's Llama; "
                       "transformers' rotates them all", partial, int(head_dim * partial), head_dim)
    return RopeSpec(
        rotary_dim=int(head_dim * partial),
        theta=float(params["rope_theta"]),
        rope_type=_ROPE_ALIASES[rope_type],
        factor=factor,
        max_position_embeddings=max_pos,
        # transformers fills a missing one with max_position_embeddings (llama3 needs it; dynamic reads it too)
        original_max_position_embeddings=_original_max_pos(hf, params, rope_type) or max_pos,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # attention_factor is yarn's and longrope's (refused above); transformers ignores it for these types
        attention_scaling=1.0,
        freq_factors=tuple(map(float, hf["rope_freq_factors"])) if hf.get("rope_freq_factors") else None,
    )


def _original_max_pos(hf: dict, params: dict, rope_type: str) -> int | None:
    """llama3's pre-scaling context: a top-level original_max_position_embeddings wins over rope_scaling's (as
    transformers' standardize_rope_params)."""
    top = hf.get("original_max_position_embeddings") if rope_type == "llama3" else None
    return top or params.get("original_max_position_embeddings")


def _sliding_windows(hf: dict, num_layers: int, arch: str) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    qwen = arch.startswith(("Qwen2", "Qwen3"))
    if qwen and not hf.get("use_sliding_window"):  # transformers' Qwen configs drop the window then, whatever
        return ()  # layer_types say
    layer_types = hf.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ConfigError(f"unsupported layer_types {sorted(unknown)}")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if qwen:
        if window is None:
            return ()
        first = hf.get("max_window_layers", 28)  # transformers' Qwen2Config / Qwen3Config default
        return tuple(window if i >= first else None for i in range(num_layers))
    if arch.startswith("Mistral") and window is not None:
        return (int(window),) * num_layers
    return ()


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _check_supported(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"hidden_act={act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
    method = (hf.get("quantization_config") or {}).get("quant_method", "?")
    if hf.get("quantization_config") and str(method).lower() != "awq":  # AWQ: lmjax.loader.awq
        raise ConfigError(f"quantized checkpoints (quant_method={method!r}) are not supported yet (only 'awq')")


def model_config_from_hf(hf: dict, arch: str, **overrides: Any) -> ModelConfig:
    """Parse an HF config dict for architecture `arch`; `overrides` are TurboMind's engine fields."""
    _check_supported(hf)
    hidden, heads = int(_get(hf, "hidden_size")), int(_get(hf, "num_attention_heads"))
    head_dim = int(_get(hf, "head_dim", hidden // heads))
    layers = int(_get(hf, "num_hidden_layers"))
    max_pos = int(_get(hf, "max_position_embeddings", 2048))
    bias = bool(hf.get("bias", False))  # InternLM2 names its q/k/v/o bias flag `bias`
    is_qwen2 = arch.startswith("Qwen2")
    # transformers reads `attention_bias` in Llama and Qwen3 only (`mlp_bias` in Llama only): Mistral's and Qwen2's
    # layers hard-code theirs, so a stray true there means nothing (it made the load ask for missing tensors)
    attention_bias = arch.startswith(("Llama", "Qwen3")) and bool(hf.get("attention_bias", False))
    use_logn = bool(overrides.get("use_logn_attn") or hf.get("use_logn_attn", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_get(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_get(hf, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        rope=_rope_spec(hf, head_dim, max_pos, overrides),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # qkv_bias / o_bias: lmjax's own GGUF configs say each (lmjax.loader.gguf); HF configs never do
        qkv_bias=hf.get("lmjax_qkv_bias", is_qwen2 or bias or attention_bias),
        o_bias=hf.get("lmjax_o_bias", bias or attention_bias),
        mlp_bias=arch.startswith("Llama") and bool(hf.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3"),
        sliding_windows=_sliding_windows(hf, layers, arch),
        use_logn_attn=use_logn,
        logn_max_position=int(hf.get("seq_length", max_pos)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )
