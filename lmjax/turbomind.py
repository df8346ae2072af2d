"""Old LMDeploy's `from lmdeploy.turbomind import EngineConfig` (the seed docs' TurboMind example)."""
from lmjax.lmdeploy_config import TurbomindEngineConfig as EngineConfig

__all__ = ["EngineConfig"]
