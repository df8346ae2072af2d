"""`lmdeploy.messages`' names (`from lmdeploy.messages import GenerationConfig, Response`, as lagent
writes), re-exported from where lmjax keeps them. Light: importing this module starts no JAX."""
from lmjax.api.outputs import Response
from lmjax.config import GenerationConfig
from lmjax.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig

__all__ = ["GenerationConfig", "PytorchEngineConfig", "Response", "TurbomindEngineConfig"]
