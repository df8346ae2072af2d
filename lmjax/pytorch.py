"""Old LMDeploy's `from lmdeploy.pytorch import EngineConfig` (the seed docs' PyTorch-backend example)."""
from lmjax.lmdeploy_config import PytorchEngineConfig as EngineConfig

__all__ = ["EngineConfig"]
