"""Architectures lmjax runs, keyed by the `architectures` field of HF config.json."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from lmjax.models.config import ConfigError, ModelConfig, model_config_from_hf
from lmjax.models.internlm2 import internlm2_to_hf
from lmjax.models.llama import LlamaForCausalLM

TensorMap = Callable[[Iterable[tuple[str, np.ndarray]], ModelConfig], Iterator[tuple[str, np.ndarray]]]


def _identity(tensors, cfg):
    return iter(tensors)


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_cls: type
    tensor_map: TensorMap = _identity  # checkpoint names -> HF Llama names


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM),
    "MistralForCausalLM": Architecture(LlamaForCausalLM),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM),
    "InternLM2ForCausalLM": Architecture(LlamaForCausalLM, internlm2_to_hf),
}


# model_type -> architecture, for a config.json without `architectures` (a bare `LlamaConfig().save_pretrained`),
# which transformers' AutoModelForCausalLM maps the same way
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "internlm2": "InternLM2ForCausalLM"}


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    model_type = hf_config.get("model_type")
    if not archs and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    what = f"architectures {archs!r}" if archs else f"no architectures and model_type {model_type!r}"
    raise ConfigError(f"unsupported model: config.json has {what}; supported architectures: "
                      f"{sorted(ARCHITECTURES)} (model_type {sorted(_BY_MODEL_TYPE)})")


def parse_config(hf_config: dict, **overrides) -> ModelConfig:
    return model_config_from_hf(hf_config, architecture_of(hf_config), **overrides)
