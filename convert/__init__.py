"""Checkpoint conversion: HF directory or GGUF file -> Orbax checkpoint directory (see convert.convert)."""
from convert.convert import convert_checkpoint

__all__ = ["convert_checkpoint"]
