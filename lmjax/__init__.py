"""lmjax: an LLM inference engine in JAX with LMDeploy's `pipeline` and vLLM's `LLM` as its two facades.

The public names load on first use (PEP 562), so `import lmjax.cli` imports no JAX: `lmjax --help` stays
instant, and `lmjax convert --tp N` can still set XLA's host device count before JAX starts.

As in LMDeploy, `lmjax.serve(model_path, ...)` launches the api_server in a subprocess and returns an
`APIClient` (lmjax.serve.launch); `lmjax.serve` is also the serving subpackage, a module that can be called.
`version_info` is the LMDeploy API release lmjax mirrors, not lmjax's own (lmjax/version.py says why).
"""
from __future__ import annotations

import importlib

from lmjax.env import apply_xla_flag_defaults
from lmjax.version import __version__, version_info  # noqa: F401  (light: no JAX)

apply_xla_flag_defaults()  # before any JAX backend starts: XLA reads its flags once (see lmjax.env)

_EXPORTS = {
    "AsyncEngine": "lmjax.api.async_engine", "LLM": "lmjax.api.llm", "CompletionOutput": "lmjax.api.outputs",
    "BeamSearchParams": "lmjax.api.beam_search", "PoolingParams": "lmjax.api.embed",
    "EmbeddingRequestOutput": "lmjax.api.embed", "LLMEngine": "lmjax.api.vllm_engine",
    "EngineArgs": "lmjax.api.vllm_engine", "RequestOutputKind": "lmjax.config",
    "Logprob": "lmjax.api.outputs", "RequestOutput": "lmjax.api.outputs", "Response": "lmjax.api.outputs",
    "Pipeline": "lmjax.api.pipeline", "pipeline": "lmjax.api.pipeline", "ChatTemplateConfig": "lmjax.config",
    "EngineConfig": "lmjax.config", "GenerationConfig": "lmjax.config", "SamplingParams": "lmjax.config",
    "GuidedDecodingParams": "lmjax.guided_params", "StructuredOutputsParams": "lmjax.guided_params",
    "PytorchEngineConfig": "lmjax.lmdeploy_config", "TurbomindEngineConfig": "lmjax.lmdeploy_config",
    "client": "lmjax.serve.launch", "TextPrompt": "lmjax.inputs", "TokensPrompt": "lmjax.inputs",
}
# Subpackages that are public names too: `lmjax.serve` (callable, see lmjax/serve/__init__.py)
_SUBPACKAGES = ("serve",)
# serve and client need the serve extra (httpx): a star import must work without it
__all__ = sorted({*_EXPORTS, "__version__", "version_info"} - {"client"})


def __getattr__(name: str):
    if name in _SUBPACKAGES:  # importing it binds it here too, so later lookups skip this function
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
