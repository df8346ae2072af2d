"""lmjax: an LLM inference engine in JAX with LMDeploy's `pipeline` and vLLM's `LLM` as its two facades."""
from lmjax.env import apply_xla_flag_defaults

apply_xla_flag_defaults()  # before any JAX backend starts: XLA reads its flags once (see lmjax.env)
from lmjax.api.async_engine import AsyncEngine
from lmjax.api.llm import LLM
from lmjax.api.outputs import CompletionOutput, Logprob, RequestOutput, Response
from lmjax.api.pipeline import Pipeline, pipeline
from lmjax.config import ChatTemplateConfig, EngineConfig, GenerationConfig, SamplingParams
from lmjax.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig

__all__ = ["LLM", "AsyncEngine", "pipeline", "Pipeline", "GenerationConfig", "SamplingParams", "EngineConfig",
           "TurbomindEngineConfig", "PytorchEngineConfig", "ChatTemplateConfig", "Response", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
